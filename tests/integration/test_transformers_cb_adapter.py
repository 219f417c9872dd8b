"""The transformers continuous-batching adapter, in-process, on the real engine and model."""

from __future__ import annotations

import pytest

from kvdiag.collectors import transformers_cb as tcb
from kvdiag.collectors.transformers_cb_hooks import fold_hash
from kvdiag.events.schema import BlockStored, KVPoolInfo
from kvdiag.events.sinks import ListSink

from demo_invariants import expected_blocks, replay_events


def test_install_and_uninstall_restore_the_original_class_attributes():
    before = {(cls, name): cls.__dict__.get(name) for cls, name in tcb.patch_points()}
    adapter = tcb.install(ListSink())
    try:
        for (cls, name), original in before.items():
            assert cls.__dict__.get(name) is not original, f"{cls.__name__}.{name} not wrapped"
        with pytest.raises(RuntimeError):
            tcb.TransformersCBAdapter(ListSink()).install()
    finally:
        adapter.uninstall()
    for (cls, name), original in before.items():
        assert cls.__dict__.get(name) is original, f"{cls.__name__}.{name} not restored"
    assert tcb.installed_adapter() is None


def test_fold_hash_keeps_63_bits_and_is_injective_on_the_low_bits():
    for h in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0x9E3779B97F4A7C15):
        folded = fold_hash(h)
        assert 0 <= folded < (1 << 63)
    assert fold_hash(5) != fold_hash(6)


@pytest.mark.model
def test_adapter_events_match_the_engine_ledger(model_dir):
    """Six chats sharing a system prompt: the events account for every block, and the replayed
    ledger equals the engine's own ledger at the end."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    system = "You are a support assistant of a small bookshop. Be brief and kind. " * 4
    prompts = []
    for i in range(6):
        ids = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": f"Question {i}: is order {i} shipped?"}],
                                      add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    page = 16
    sink = ListSink()
    adapter = tcb.install(sink, record_token_ids=True)  # the engine's keys are recomputed from them
    try:
        manager = model.init_continuous_batching(
            generation_config=GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(page_size=page, num_blocks=96,
                                                                max_batch_tokens=128))
        manager.start()
        ids = [manager.add_request(prompts[0], request_id="r0")]
        manager.get_result("r0", timeout=120)  # the first one fills the prefix cache
        ids += [manager.add_request(p, request_id=f"r{i}") for i, p in enumerate(prompts[1:], 1)]
        for rid in ids[1:]:
            assert manager.get_result(rid, timeout=300) is not None
        cache = manager.batch_processor.cache
        allocator = next(iter(cache.cache_allocators.values()))
        engine_cached = set(allocator.ledger.cached_blocks)
        engine_hashes = {b: fold_hash(h) for b, h in allocator.ledger.block_to_hash.items()}
        manager.stop(block=True)
    finally:
        adapter.uninstall()
    events = sink.events
    info = [e for e in events if isinstance(e, KVPoolInfo)]
    assert info and info[0].block_size_tokens == page and info[0].num_blocks == 96

    r = replay_events(events, page)
    assert not r.problems, r.problems[:5]
    assert set(r.finished) == {f"r{i}" for i in range(6)}
    assert all(not blocks for blocks in r.held_at_finish.values()), r.held_at_finish
    # the engine's own ledger at the end: the hashes it holds and the blocks it keeps cached are
    # exactly what the events say
    stored = {e.block_id: e.block_hash for e in events if isinstance(e, BlockStored)}
    assert stored == engine_hashes
    assert engine_cached == r.cached_blocks_at_end
    # prefix hits: what the engine's matcher finds on the ledger replayed up to each request
    for rid, fin in r.finished.items():
        assert fin.cached_prompt_tokens == r.prefix_hit_tokens.get(rid, 0) == r.expected_cached_tokens[rid], rid
        assert fin.output_tokens == 6
    assert r.finished["r3"].cached_prompt_tokens > 0
    # blocks per request: every token written to the cache, in whole pages
    for rid, fin in r.finished.items():
        assert r.blocks_at_finish[rid] == expected_blocks(fin.prompt_tokens, fin.output_tokens, page), rid


@pytest.mark.model
def test_inject_leak_really_skips_the_engine_release(model_dir):
    """Fault injection: every 2nd finished request keeps its blocks in the engine itself."""
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    sink = ListSink()
    adapter = tcb.install(sink, inject_leak_every=2)
    try:
        manager = model.init_continuous_batching(
            generation_config=GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=32,
                                                                max_batch_tokens=64, allow_block_sharing=False))
        manager.start()
        for i in range(4):  # one at a time, so the finishing order is known
            manager.add_request(list(range(100 + i, 140 + i)), request_id=f"q{i}")
            assert manager.get_result(f"q{i}", timeout=120) is not None
        allocator = next(iter(manager.batch_processor.cache.cache_allocators.values()))
        engine_tables = {rid: list(blocks) for rid, blocks in allocator.block_table.items()}
        manager.stop(block=True)
    finally:
        adapter.uninstall()
    assert adapter.leaked_requests == ["q1", "q3"]
    assert set(engine_tables) == {"q1", "q3"}  # the engine still holds their blocks
    r = replay_events(sink.events, 16)
    assert {rid: sorted(b) for rid, b in r.held_at_finish.items() if b} == \
        {rid: sorted(b) for rid, b in engine_tables.items()}
