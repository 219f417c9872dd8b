"""Workloads for capacity planning: when requests arrive and how many tokens they bring and
generate, from length distributions at a QPS or from a trace.

A :class:`Workload` holds, per request in arrival order: ``arrival_s``, ``prompt_tokens``,
``output_tokens``; when a log recorded them, ``first_token_s`` and ``finish_s``; and, when the
trace carries prompt content (Mooncake ``hash_ids``, token ids, a kvdiag log's prompt token
ids), the chained keys of its prompt blocks, so that prefix sharing between live requests can
be counted exactly.

Length distributions (``--prompt-tokens``, ``--output-tokens``):

- ``N`` or ``fixed:N``: every request N tokens;
- ``lognormal:MEDIAN,SIGMA``: ``round(MEDIAN * exp(SIGMA * Z))``, Z standard normal (so MEDIAN
  is the median and SIGMA the standard deviation of the log), at least 1 token.

Synthetic arrivals are a Poisson process at the QPS (exponential gaps), seeded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from kvdiag.traces.lines import BadLine, ReadOptions, TraceFormatError, decoded_lines
from kvdiag.traces import request_traces as traces


@dataclass
class PromptKeys:
    """Chained content keys of every request's prompt blocks: request ``i`` has
    ``key_ids[offsets[i]:offsets[i+1]]`` (dense ids, equal id = equal prefix), and key ``k``
    covers ``key_blocks[k]`` engine blocks."""

    key_ids: np.ndarray
    offsets: np.ndarray
    key_blocks: np.ndarray


@dataclass
class Workload:
    """Requests in arrival order (see the module docstring); times in seconds from the trace's
    own zero."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    source: str
    first_token_s: Optional[np.ndarray] = None
    finish_s: Optional[np.ndarray] = None
    prompt_keys: Optional[PromptKeys] = None
    notes: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.arrival_s)

    @property
    def recorded_timing(self) -> bool:
        """True when every request's first-token and finish times were recorded."""
        return self.first_token_s is not None and self.finish_s is not None


class WorkloadError(ValueError):
    """A workload that cannot be built; the message names the place (``file:line: ...`` or the
    option)."""


# ---------------------------------------------------------------- distributions


def parse_lengths(text: str, option: str):
    """``--prompt-tokens``/``--output-tokens`` text -> ``sample(rng, n)`` and its description."""
    t = text.strip().lower()
    m = re.fullmatch(r"(?:fixed:)?(\d+)", t)
    if m:
        n_tokens = int(m.group(1))
        if n_tokens < 1:
            raise WorkloadError(f"{option} {text!r}: expected at least 1 token")
        return (lambda rng, n: np.full(n, n_tokens, np.int64)), f"fixed {n_tokens} tokens"
    m = re.fullmatch(r"lognormal:(\d+(?:\.\d+)?),(\d+(?:\.\d+)?)", t)
    if m:
        median, sigma = float(m.group(1)), float(m.group(2))
        if median < 1:
            raise WorkloadError(f"{option} {text!r}: expected a median of at least 1 token")

        def sample(rng, n):
            return np.maximum(1, np.rint(median * np.exp(sigma * rng.standard_normal(n)))).astype(np.int64)
        return sample, f"lognormal, median {median:g} tokens, sigma {sigma:g} (of the log)"
    raise WorkloadError(f"{option} {text!r}: expected N, fixed:N or lognormal:MEDIAN,SIGMA")


def synthetic(qps: float, requests: int, prompt: str, output: str, seed: int = 0) -> Workload:
    """``requests`` Poisson arrivals at ``qps`` with lengths drawn from the two distributions."""
    if not qps > 0 or not np.isfinite(qps):
        raise WorkloadError(f"--qps {qps}: expected a positive number of requests per second")
    if requests < 1:
        raise WorkloadError(f"--requests {requests}: expected at least 1")
    sample_prompt, prompt_text = parse_lengths(prompt, "--prompt-tokens")
    sample_output, output_text = parse_lengths(output, "--output-tokens")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / qps, requests))
    arrivals -= arrivals[0]
    return Workload(arrivals, sample_prompt(rng, requests), sample_output(rng, requests),
                    f"Poisson arrivals at {qps:g} QPS (seed {seed}); prompts {prompt_text}; "
                    f"outputs {output_text}")


def resampled(workload: Workload, qps: float, requests: int, seed: int = 0) -> Workload:
    """Poisson arrivals at ``qps`` whose (prompt, output) pairs are drawn with replacement from
    ``workload``'s requests (their empirical joint distribution)."""
    if not qps > 0 or not np.isfinite(qps):
        raise WorkloadError(f"--qps {qps}: expected a positive number of requests per second")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / qps, requests))
    arrivals -= arrivals[0]
    pick = rng.integers(0, workload.requests, requests)
    return Workload(arrivals, workload.prompt_tokens[pick], workload.output_tokens[pick],
                    f"Poisson arrivals at {qps:g} QPS (seed {seed}); (prompt, output) pairs "
                    f"resampled from {workload.source}",
                    notes=workload.notes + ["resampled requests carry no prompt content: prefix "
                                            "sharing needs --sharing-hit-rate"])


# ---------------------------------------------------------------- traces


MOONCAKE_KEY_TOKENS = traces.MOONCAKE_BLOCK_TOKENS


def _mooncake_line(line: bytes) -> traces.MooncakeLine:
    """A Mooncake line as the sharing simulator reads it, which the plan needs with its
    output length."""
    req = traces.mooncake_line(line)
    if req.output_length is None:
        raise BadLine("output_length: expected the request's output tokens, found none")
    return req


def _dense_keys(raw_keys: list[np.ndarray], key_tokens: list[np.ndarray],
                block_size_tokens: int) -> PromptKeys:
    """Dense ids of the keys and the engine blocks each covers (the most any request says)."""
    offsets = np.zeros(len(raw_keys) + 1, np.int64)
    offsets[1:] = np.cumsum([len(k) for k in raw_keys])
    flat = np.concatenate(raw_keys) if raw_keys else np.zeros(0, np.int64)
    tokens = np.concatenate(key_tokens) if key_tokens else np.zeros(0, np.int64)
    uniq, dense = np.unique(flat, return_inverse=True)
    blocks = np.zeros(len(uniq), np.int64)
    np.maximum.at(blocks, dense, -(-tokens // block_size_tokens))
    return PromptKeys(dense.astype(np.int64), offsets, blocks)


def _ordered(w: Workload) -> Workload:
    """The workload sorted by arrival (stable), times shifted to start at 0."""
    order = np.argsort(w.arrival_s, kind="stable")
    if (order == np.arange(len(order))).all() and (len(order) == 0 or w.arrival_s[0] == 0):
        return w
    t0 = w.arrival_s[order[0]] if len(order) else 0.0
    keys = w.prompt_keys
    if keys is not None:
        lengths = np.diff(keys.offsets)[order]
        starts = keys.offsets[:-1][order]
        idx = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        keys = PromptKeys(keys.key_ids[idx], offsets, keys.key_blocks)
    shift = (lambda a: None if a is None else a[order] - t0)
    return Workload(w.arrival_s[order] - t0, w.prompt_tokens[order], w.output_tokens[order],
                    w.source, shift(w.first_token_s), shift(w.finish_s), keys, w.notes)


def _need_requests(path: Path, n: int, read: ReadOptions) -> None:
    if n == 0:
        first = f" (first unreadable: {read.problems[0]})" if read.problems else ""
        raise TraceFormatError(f"{path}:1: expected at least one readable request{first}")


def load_mooncake(path: str | Path, block_size_tokens: int,
                  read: Optional[ReadOptions] = None) -> Workload:
    """A Mooncake trace: arrivals from ``timestamp`` (ms), ``input_length`` and
    ``output_length``, and its ``hash_ids`` as prompt keys (512 tokens each, the last one
    what remains of the prompt)."""
    path, read = Path(path), read or ReadOptions()
    arrivals, prompts, outputs, keys, key_tokens = [], [], [], [], []
    for _, req in decoded_lines(path, _mooncake_line, read):
        arrivals.append(req.timestamp / 1e3)
        prompts.append(req.input_length)
        outputs.append(req.output_length)
        keys.append(np.asarray(req.hash_ids, np.int64))
        tokens = np.full(len(req.hash_ids), MOONCAKE_KEY_TOKENS, np.int64)
        if len(tokens):
            tokens[-1] = req.input_length - MOONCAKE_KEY_TOKENS * (len(tokens) - 1)
        key_tokens.append(tokens)
    _need_requests(path, len(arrivals), read)
    notes = []
    if MOONCAKE_KEY_TOKENS % block_size_tokens:
        notes.append(f"Mooncake keys cover 512 tokens, not a multiple of the {block_size_tokens}-"
                     "token block: a shared key counts as ceil(512 / block) blocks")
    return _ordered(Workload(np.asarray(arrivals, float), np.asarray(prompts, np.int64),
                             np.asarray(outputs, np.int64), f"{path} (mooncake)",
                             prompt_keys=_dense_keys(keys, key_tokens, block_size_tokens),
                             notes=notes))


def load_tokens(path: str | Path, block_size_tokens: int, output: Optional[str] = None,
                seed: int = 0, read: Optional[ReadOptions] = None) -> Workload:
    """A token-id trace (``{"timestamp": s, "token_ids": [...]}`` a line, optional
    ``output_tokens`` and ``extra_keys``), read by :func:`kvdiag.traces.request_traces.token_lines`
    as ``replay`` reads it: prompts and their full blocks' keys; outputs from the line, else
    drawn from ``output`` (a length distribution)."""
    path, read = Path(path), read or ReadOptions()
    keyed = list(traces.token_lines(path, block_size_tokens, read=read))
    rows = [(lineno, req) for lineno, req, _ in keyed]
    _need_requests(path, len(rows), read)
    missing = [lineno for lineno, req in rows if req.timestamp is None]
    if missing:
        raise TraceFormatError(f"{path}:{missing[0]}: timestamp: expected the arrival time in "
                               "seconds (a plan needs arrivals)")
    outputs = np.asarray([-1 if r.output_tokens is None else r.output_tokens for _, r in rows], np.int64)
    notes = []
    if (outputs < 0).any():
        if output is None:
            lineno = rows[int(np.argmax(outputs < 0))][0]
            raise TraceFormatError(f"{path}:{lineno}: output_tokens: expected the request's "
                                   "output length (or pass --output-tokens)")
        sample, text = parse_lengths(output, "--output-tokens")
        drawn = sample(np.random.default_rng(seed), len(rows))
        outputs = np.where(outputs < 0, drawn, outputs)
        notes.append(f"output lengths not in the trace: {text}")
    keys = [k for _, _, k in keyed]
    key_tokens = [np.full(len(k), block_size_tokens, np.int64) for k in keys]
    return _ordered(Workload(np.asarray([r.timestamp for _, r in rows], float),
                             np.asarray([len(r.token_ids) for _, r in rows], np.int64), outputs,
                             f"{path} (token ids)",
                             prompt_keys=_dense_keys(keys, key_tokens, block_size_tokens),
                             notes=notes))


def from_logs(logs, block_size_tokens: int, source: str) -> Workload:
    """A kvdiag log's requests: arrival from ``request_arrived``, prompt and output lengths from
    ``request_finished``, first token at arrival + ``ttft_ns`` and finish at the finished event;
    prompt keys from the arrival's ``token_ids`` (or, in a hashes-mode log, its salted
    ``chunk_hashes``, at block sizes that are multiples of their chunk) when every request has
    them. Requests that never finished are left out (counted in the notes)."""
    from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, chunk_hashes, keys_from_chunks

    arrived = logs.frame("request_arrived")
    finished = logs.frame("request_finished")
    if arrived.empty or finished.empty:
        raise WorkloadError(f"{source}: expected request_arrived and request_finished events, "
                            f"found {len(arrived)} and {len(finished)}")
    arrived = arrived.drop_duplicates(["node", "request_id"], keep="first")
    finished = finished.drop_duplicates(["node", "request_id"], keep="last")
    both = arrived.merge(finished, on=["node", "request_id"], suffixes=("_arrived", ""))
    both = both.sort_values("ts_ns_arrived", kind="stable").reset_index(drop=True)
    notes = []
    if len(both) < len(arrived):
        notes.append(f"{len(arrived) - len(both)} request(s) arrived but never finished: left out")
    if both.empty:
        raise WorkloadError(f"{source}: expected requests with both request_arrived and "
                            "request_finished events, found none")
    t0 = int(both["ts_ns_arrived"].min())
    arrival = (both["ts_ns_arrived"].to_numpy(np.int64) - t0) / 1e9
    finish = (both["ts_ns"].to_numpy(np.int64) - t0) / 1e9
    ttft = both["ttft_ns"].to_numpy(dtype=float, na_value=np.nan) / 1e9
    first = np.where(np.isnan(ttft), finish, np.minimum(arrival + ttft, finish))
    prompt_keys = None
    token_ids, hashed = both.get("token_ids"), both.get("chunk_hashes")
    keys = None

    def every(column) -> bool:
        return column is not None and column.map(lambda t: isinstance(t, (list, np.ndarray))).all()

    if every(token_ids):
        keys = [chunk_hashes(list(t), block_size_tokens) for t in token_ids]
    elif every(hashed):
        if block_size_tokens % CONTENT_CHUNK_TOKENS == 0:
            keys = [keys_from_chunks(list(t), block_size_tokens) for t in hashed]
        else:
            notes.append(f"prompts are hashed in {CONTENT_CHUNK_TOKENS}-token chunks: no prefix "
                         f"keys at {block_size_tokens}-token blocks (record with --record-tokens)")
    if keys is not None:
        prompt_keys = _dense_keys(keys, [np.full(len(k), block_size_tokens, np.int64) for k in keys],
                                  block_size_tokens)
    return Workload(arrival, both["prompt_tokens"].to_numpy(np.int64),
                    both["output_tokens"].to_numpy(np.int64), f"{source} (kvdiag log)",
                    first_token_s=first, finish_s=np.maximum(finish, arrival),
                    prompt_keys=prompt_keys, notes=notes)
