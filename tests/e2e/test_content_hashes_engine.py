"""The agent on the real transformers engine records prompts as salted chunk hashes by default:
no token id in any event, and replay of its log equals replay of the same run's token-id log,
rebuilt independently from the engine's own outputs (prompt and generated tokens)."""

from __future__ import annotations

import json

import msgspec
import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

SYSTEM = ("You are a meticulous travel agent. Answer in two sentences and always name a concrete "
          "place to visit, with opening hours when you know them, and mention the nearest "
          "public transport stop.")
QUESTIONS = ["What should I see in Lyon?", "How do I list open ports?", "Plan a day in Kyoto.",
             "Where can I swim in Zurich?"]


def test_default_agent_log_holds_hashes_that_replay_like_token_ids(tmp_path, model_dir, capsys,
                                                                  monkeypatch):
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvdiag import agent
    from kvdiag.cli import main
    from kvdiag.events.eventlog import iter_events, read_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.pool.hashing import salted_chunk_hashes
    from kvdiag.events.schema import BlockStored, RequestArrived, ShadowSharing

    monkeypatch.delenv("KVDIAG_RECORD_TOKENS", raising=False)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompts = [list(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": q}],
                                            add_generation_prompt=True)["input_ids"])
               for q in QUESTIONS]
    log = tmp_path / "default.kvlog"
    run = agent.Agent(log_path=str(log), live=False, model=str(model_dir), block_size_tokens=32,
                      host_memory=False, hardware=False).start()
    cfg = ContinuousBatchingConfig(page_size=32, num_blocks=64, allow_block_sharing=True)
    gen = GenerationConfig(max_new_tokens=40, do_sample=False)
    outputs = {}
    try:  # two waves: the second finds the first's system prompt (and its answers' blocks)
        outputs.update(model.generate_batch(inputs=prompts[:2], generation_config=gen,
                                            continuous_batching_config=cfg, persistent_manager=True))
        outputs.update(model.generate_batch(inputs=prompts[2:], generation_config=gen,
                                            continuous_batching_config=cfg, persistent_manager=True))
    finally:
        run.stop()
    header = read_header(log)
    assert header.content == "hashes" and header.content_salt
    salt = header.content_salt
    events = list(iter_events(log, strict=True))
    for ev in events:  # every event of every type
        assert not msgspec.to_builtins(ev).get("token_ids"), ev
    assert any(isinstance(ev, ShadowSharing) for ev in events)  # the live what-ifs ran on hashes

    # rebuild the token-id log of the same run from the engine's outputs, independently
    seqs = {rid: list(o.prompt_ids) + list(o.generated_tokens) for rid, o in outputs.items()}
    rebuilt, stored_blocks = [], 0
    for ev in events:
        if isinstance(ev, RequestArrived):
            prompt = list(outputs[ev.request_id].prompt_ids)
            assert ev.chunk_hashes == salted_chunk_hashes(prompt, salt).tolist()
            assert ev.partial_tokens == len(prompt) % 16
            ev = msgspec.structs.replace(ev, token_ids=prompt, chunk_hashes=None, partial_tokens=None)
        elif isinstance(ev, BlockStored) and ev.request_id in seqs:
            seq, page = seqs[ev.request_id], ev.num_tokens
            keys = salted_chunk_hashes(seq, salt).tolist()
            index = [i for i in range(len(seq) // page)
                     if keys[i * page // 16:(i + 1) * page // 16] == ev.chunk_hashes]
            assert len(index) == 1, ev
            i = index[0]
            ev = msgspec.structs.replace(ev, token_ids=seq[i * page:(i + 1) * page], chunk_hashes=None)
            stored_blocks += 1
        rebuilt.append(ev)
    assert stored_blocks > 0
    ids_log = tmp_path / "ids.kvlog"
    with LogWriter(ids_log, msgspec.structs.replace(header, content="token_ids", content_salt=None,
                                                    content_chunk_tokens=None)) as w:
        for ev in rebuilt:
            w.record(ev)

    def replay(path, bs):
        capsys.readouterr()
        assert main(["replay", str(path), "--json", "--block-size", str(bs), "--policy", "lru",
                     "--policy", "fifo", "--capacity", "2", "--capacity", "8",
                     "--capacity", "unbounded"]) == 0
        out = json.loads(capsys.readouterr().out)
        out.pop("source")
        return out

    for bs in (16, 32, 64, 128):
        hashed, ids = replay(log, bs), replay(ids_log, bs)
        assert hashed == ids
    assert max(r["token_hit_rate"] for r in replay(log, 32)["rows"]) > 0
