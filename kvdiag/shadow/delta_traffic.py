"""Chat traffic on a transformers decoder, with a :class:`DeltaWriter` writing its KV blocks out.

:func:`delta_traffic` plays chat turns (conversation key, system prompt, user text) in order,
greedy-decoding each answer on a DynamicCache the way a paged engine with prefix sharing
would hold it:

- prefix sharing: the full ``block_tokens`` blocks of every finished turn are kept under a
  chained key of their token ids (as transformers' engine and vLLM do); a new turn reuses the
  longest chain of whole blocks that matches its prompt (its own earlier turns or another
  conversation with the same system prompt) and prefills only the rest. ``share_prefixes=False``
  prefills every turn from scratch.
- after each turn, the session's KV is written out block by block (offload / persistence of the
  conversation for its next turn): block ``i`` of the conversation is written when its tokens
  differ from what was last written for it (a new block, or the partial last block grown or
  changed: a rewrite); unchanged blocks are not written again.
- the attention error of a block's reconstruction uses the turn's last decode query.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from kvdiag.kernels.attention import QueryCapture
from kvdiag.kernels.delta import DeltaWriter


@dataclass
class DeltaRun:
    turns: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens served from shared blocks
    decode_tokens: int = 0
    blocks_seen: int = 0  # blocks of the sequences after each turn
    blocks_written: int = 0
    model_ns: int = 0
    writer_ns: int = 0
    texts: list[str] = field(default_factory=list)


def delta_traffic(model, tokenizer, writer: DeltaWriter, turns: Iterable[tuple[str, str, str]],
                  max_new_tokens: int = 24, block_tokens: int = 32, share_prefixes: bool = True,
                  on_turn=None) -> DeltaRun:
    """Play ``turns`` = (conversation key, system prompt, user text); see the module docstring."""
    from transformers import DynamicCache

    run = DeltaRun()
    histories: dict[str, list[dict]] = {}
    written: dict[tuple[str, int], tuple[int, ...]] = {}
    shared: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # chain key -> per-layer block KV
    capture = QueryCapture(model)
    scaling = capture.scaling()
    eos = tokenizer.eos_token_id
    try:
        with torch.no_grad():
            for conv, system, user in turns:
                t0 = time.perf_counter_ns()
                messages = histories.setdefault(conv, [{"role": "system", "content": system}])
                messages.append({"role": "user", "content": user})
                ids = _prompt_ids(tokenizer, messages)
                prompt = [int(x) for x in ids[0]]
                cache = DynamicCache(config=model.config)
                hit = _reuse(shared, prompt, block_tokens, cache) if share_prefixes else 0
                generated, queries = _decode(model, capture, ids[:, hit:], cache, max_new_tokens, eos)
                answer = tokenizer.decode([g for g in generated if g != eos], skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})
                run.texts.append(answer)
                seq = prompt + generated[:-1]
                kv = [(layer.keys, layer.values) for layer in cache.layers]
                assert kv[0][0].shape[2] == len(seq), (kv[0][0].shape, len(seq))
                t1 = time.perf_counter_ns()
                _write_blocks(run, writer, written, conv, seq, block_tokens, kv, queries, scaling)
                t2 = time.perf_counter_ns()
                if share_prefixes:
                    _keep(shared, seq, block_tokens, kv)
                run.turns += 1
                run.prompt_tokens += len(prompt)
                run.reused_tokens += hit
                run.decode_tokens += len(generated)
                run.model_ns += t1 - t0
                run.writer_ns += t2 - t1
                if on_turn is not None:
                    on_turn(run)
    finally:
        capture.close()
    return run


def _prompt_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """The chat template's token ids of ``messages`` with the generation prompt, shape (1, n)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    return ids


def _decode(model, capture: QueryCapture, ids: torch.Tensor, cache, max_new_tokens: int, eos):
    """Prefill ``ids`` onto ``cache`` and greedy-decode up to ``max_new_tokens`` (stopping at
    ``eos``); returns (generated token ids, each layer's last decode query)."""
    capture.armed = True
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits
    generated = [int(logits[0, -1].argmax())]
    while len(generated) < max_new_tokens and generated[-1] != eos:
        logits = model(input_ids=torch.tensor([[generated[-1]]]), cache=cache, use_cache=True).logits
        generated.append(int(logits[0, -1].argmax()))
    capture.armed = False
    queries = [q[:, :, -1:] for q in capture.queries()]
    capture.clear()
    return generated, queries


def _write_blocks(run: DeltaRun, writer: DeltaWriter, written: dict, conv: str, seq: list[int],
                  block_tokens: int, kv, queries, scaling) -> None:
    """Write the blocks of ``seq`` whose tokens differ from what was last written for them,
    then flush the writer's sink; counts blocks seen and written into ``run``."""
    for i in range(0, len(seq), block_tokens):
        toks = tuple(seq[i: i + block_tokens])
        run.blocks_seen += 1
        if written.get((conv, i // block_tokens)) == toks:
            continue
        writer.write(conv, i // block_tokens, kv, i, i + len(toks), queries, scaling)
        written[(conv, i // block_tokens)] = toks
        run.blocks_written += 1
    writer.sink.flush()


def _chain(seq: list[int], block_tokens: int):
    """(start, chain key) of each full block of ``seq``."""
    key = 0
    for i in range(0, len(seq) - block_tokens + 1, block_tokens):
        key = hash((key, tuple(seq[i: i + block_tokens])))
        yield i, key


def _reuse(shared, prompt: list[int], block_tokens: int, cache) -> int:
    """Fill ``cache`` with the longest chain of shared whole blocks that prefixes ``prompt``
    (leaving at least one prompt token to compute); returns the tokens reused."""
    blocks = []
    for start, key in _chain(prompt[:-1], block_tokens):
        got = shared.get(key)
        if got is None:
            break
        blocks.append(got)
    if not blocks:
        return 0
    for layer in range(len(blocks[0])):
        cache.update(torch.cat([b[layer][0] for b in blocks], dim=2).clone(),
                     torch.cat([b[layer][1] for b in blocks], dim=2).clone(), layer)
    return len(blocks) * block_tokens


def _keep(shared, seq: list[int], block_tokens: int, kv) -> None:
    for start, key in _chain(seq, block_tokens):
        if key not in shared:
            shared[key] = [(k[:, :, start: start + block_tokens].clone(), v[:, :, start: start + block_tokens].clone())
                           for k, v in kv]


def demo_turns(num_turns: int, seed: int = 0, long_share: float = 0.3) -> list[tuple[str, str, str]]:
    """The first ``num_turns`` chat requests of the demo's traffic plan (kvdiag.demo.traffic), in
    release order: (conversation key, system prompt, user text)."""
    from kvdiag.demo.traffic import TrafficPlan

    plan = TrafficPlan(seed, rate_per_s=1.0, long_share=long_share)
    out = []
    for planned, _ in zip(plan.requests(), range(num_turns)):
        c = planned.conversation
        out.append((c.conversation_id, c.system_prompt, c.user_turns[planned.turn]))
    return out
