"""Drive a transformers decoder in-process with a DynamicCache and shadow measurements.

- :func:`shadow_generate`: greedy decoding of chat prompts (one sequence at a time) with a
  :class:`ShadowRunner` called after each sampled decode forward; returns the texts and every
  decode step's wall time (shadow work included), for the on/off latency comparison.
- :func:`shadow_logits`: teacher-forced agreement of the whole model with compressed KV. The
  text is split into a prefix (whose KV every layer compresses with the method) and a
  continuation fed token by token; for each continuation token, KL(p_exact || p_compressed)
  of the next-token distributions and whether their argmax agrees. Sparse methods drop
  positions from the cache (the kept rows keep their RoPE positions); new tokens' KV is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from kvdiag.kernels.attention import QueryCapture, attention_probs
from kvdiag.kernels.methods import Method, parse_method
from kvdiag.shadow.runner import ShadowRunner
from kvdiag.events.schema import ShadowLogits
from kvdiag.events.sinks import Sink


@dataclass
class GenerateResult:
    texts: list[str] = field(default_factory=list)
    step_ns: list[int] = field(default_factory=list)  # wall time of each decode step
    decode_tokens: int = 0
    wall_ns: int = 0

    def tokens_per_s(self) -> float:
        """Generated tokens / wall time of all decode steps."""
        return self.decode_tokens / max(1e-9, sum(self.step_ns) / 1e9)


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    """[1, T] token ids of a one-turn chat with the generation prompt appended."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    return ids


def layers_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def shadow_generate(model, tokenizer, prompts: Sequence[str], runner: Optional[ShadowRunner] = None,
                    max_new_tokens: int = 32) -> GenerateResult:
    """Greedy generation; with a ``runner``, shadow measurements on its sampled decode steps."""
    result = GenerateResult()
    capture = QueryCapture(model) if runner is not None else None
    eos = tokenizer.eos_token_id
    step_id = 0
    start = time.perf_counter_ns()
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = chat_ids(tokenizer, prompt)
                cache = _new_cache(model)
                logits = model(input_ids=ids, cache=cache, use_cache=True).logits
                generated = [int(logits[0, -1].argmax())]
                while len(generated) < max_new_tokens and generated[-1] != eos:
                    sampled = runner.should_sample() if runner is not None else False
                    t0 = time.perf_counter_ns()
                    if capture is not None:
                        capture.armed = sampled
                    logits = model(input_ids=torch.tensor([[generated[-1]]]), cache=cache,
                                   use_cache=True).logits
                    if sampled:
                        capture.armed = False
                        runner.maybe_run(step_id, lambda: layers_kv(cache), capture.queries, sampled=True)
                        capture.clear()
                    generated.append(int(logits[0, -1].argmax()))
                    result.step_ns.append(time.perf_counter_ns() - t0)
                    step_id += 1
                result.decode_tokens += len(generated) - 1
                result.texts.append(tokenizer.decode(generated, skip_special_tokens=True))
    finally:
        if capture is not None:
            capture.close()
    result.wall_ns = time.perf_counter_ns() - start
    return result


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def shadow_logits(model, input_ids: torch.Tensor, methods: Sequence[str | Method], sink: Sink,
                  prefix_tokens: Optional[int] = None) -> list[ShadowLogits]:
    """KL and top-1 agreement per method (module docstring); ``input_ids`` [1, T]."""
    total = input_ids.shape[1]
    prefix = prefix_tokens if prefix_tokens is not None else total // 2
    if not 1 <= prefix < total:
        raise ValueError(f"prefix_tokens must be in [1, {total - 1}], got {prefix}")
    cont = input_ids[:, prefix:]
    results = []
    with torch.no_grad():
        exact_cache = _new_cache(model)
        capture = QueryCapture(model)
        capture.armed = True
        try:
            model(input_ids=input_ids[:, :prefix], cache=exact_cache, use_cache=True)
            prefix_q = capture.queries()
        finally:
            capture.close()
        prefix_kv = [(k.clone(), v.clone()) for k, v in layers_kv(exact_cache)]
        exact = _teacher_forced(model, _cache_from(model, prefix_kv), cont, prefix)
        scaling = model.config.head_dim ** -0.5 if hasattr(model.config, "head_dim") else None
        for m in methods:
            method = m if isinstance(m, Method) else parse_method(m)
            compressed_kv = []
            for (k, v), q in zip(prefix_kv, prefix_q):
                p = attention_probs(q, k, scaling or k.shape[-1] ** -0.5)
                group = q.shape[1] // k.shape[1]
                mass = p.sum(2).reshape(p.shape[0], k.shape[1], group, -1).sum(2)
                c = method.compress(k, v, mass)
                if method.is_sparse:
                    compressed_kv.append((c.kv.k, c.kv.v))
                else:
                    k_hat, v_hat, _ = c.decode()
                    compressed_kv.append((k_hat, v_hat))
            approx = _teacher_forced(model, _cache_from(model, compressed_kv), cont, prefix)
            log_p, log_q = _log_softmax(exact), _log_softmax(approx)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1)
            top1 = (exact.argmax(-1) == approx.argmax(-1)).double()
            ev = ShadowLogits(ts_ns=time.time_ns(), method=method.name, tokens=int(kl.numel()),
                              kl_divergence=float(kl.mean()), top1_agreement=float(top1.mean()))
            sink.record(ev)
            results.append(ev)
    sink.flush()
    return results


def _cache_from(model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    cache = _new_cache(model)
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    return cache


def _teacher_forced(model, cache, cont: torch.Tensor, first_position: int) -> torch.Tensor:
    """Next-token logits [N, vocab] for each continuation token, fed one at a time at its true
    position (the cache may hold fewer rows than positions when a sparse method dropped some)."""
    rows = []
    for i in range(cont.shape[1]):
        pos = torch.tensor([[first_position + i]])
        out = model(input_ids=cont[:, i: i + 1], position_ids=pos, cache=cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows)
