"""kvdiag event logs read as traces: each request a row at its arrival, keyed from its token
ids, from its salted chunk hashes (the default recording) or, without either, from the
engine's block events; a second, uncounted row when it finishes adds the blocks of its prompt
and generated tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from kvdiag.events.schema import event_tag
from kvdiag.pool.hashing import CONTENT_CHUNK_TOKENS, chunk_hashes, full_sequence_chunks, keys_from_chunks
from kvdiag.pool.hit_rate import counts_toward_hit_rate
from kvdiag.traces.lines import ReadOptions, TraceFormatError
from kvdiag.traces.trace import DEFAULT_BLOCK_TOKENS, Trace, TraceBuilder

# events that put a block (by chained key) into a request's prompt, in log order; the
# engine adapter's de-duplication (a request adopting an identical hashed block) counts too
_BLOCK_REF_TAGS = ("prefix_hit", "block_stored", "block_deduplicated")


def full_sequence(prompt: list[int], stored_blocks: list[list[int]]) -> list[int]:
    """A finished request's prompt and generated tokens, as far as its engine stored full
    blocks: ``stored_blocks`` (token ids of the request's ``block_stored`` events, in order)
    that are not full blocks of the prompt continue it, the first one starting with the prompt's
    partial tail. Without such blocks (or if they do not fit) the prompt alone."""
    sizes = {len(blk) for blk in stored_blocks}
    if len(sizes) != 1:
        return list(prompt)
    bs = sizes.pop()
    k = len(prompt) // bs
    own = {tuple(prompt[j * bs:(j + 1) * bs]) for j in range(k)}
    generated = [blk for blk in stored_blocks if tuple(blk) not in own]
    tail = list(prompt[k * bs:])
    if not generated or list(generated[0][:len(tail)]) != tail:
        return list(prompt)
    return list(prompt[:k * bs]) + [t for blk in generated for t in blk]


def log_events(path: Path, read: ReadOptions, keep: Callable[[object], bool]) -> list:
    """The events of a kvdiag log that ``keep`` selects, read and checked by
    :mod:`kvdiag.events.eventlog`; its unreadable lines go through ``read`` as other formats' do
    (``strict``: the first raises; a cut last line raises unless ``partial``)."""
    from kvdiag.events import eventlog  # the log reader; imported lazily (only this format needs it)

    outcome = eventlog.ReadOutcome()
    try:
        events = [ev for ev in eventlog.iter_events(path, strict=read.strict, outcome=outcome)
                  if keep(ev)]
    except eventlog.LogFormatError as exc:
        raise TraceFormatError(str(exc)) from None
    if outcome.cut and not read.partial:
        raise TraceFormatError(f"{outcome.cut}; expected a complete log (pass --partial to "
                               "use the events before the cut)")
    read.problems.extend(outcome.problems)
    return events


def _engine_cached(finished) -> int:
    """A request's ``cached_prompt_tokens`` where the engine's hit rate counts it
    (:mod:`kvdiag.pool.hit_rate`: finished normally), else -1 (not finished, aborted, failed)."""
    if finished is None or not counts_toward_hit_rate(finished.status):
        return -1
    return finished.cached_prompt_tokens


@dataclass
class _LogRequests:
    """What a log says of its requests, by request id: arrival, finish, the blocks its events
    put in it (chained key, tokens in block) and the content of the blocks it stored (token ids,
    or chunk hashes with the tokens they cover)."""

    arrived: dict = field(default_factory=dict)
    finished: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)
    stored: dict = field(default_factory=dict)
    stored_chunks: dict = field(default_factory=dict)


def _read_requests(path: Path, read: ReadOptions) -> _LogRequests:
    """The requests of a log (the first ``request_arrived`` of an id counts, the last
    ``request_finished``)."""
    from kvdiag.events.schema import RequestArrived, RequestFinished

    out = _LogRequests()
    wanted = (RequestArrived, RequestFinished)
    for ev in log_events(path, read, lambda ev: isinstance(ev, wanted) or event_tag(ev) in _BLOCK_REF_TAGS):
        if isinstance(ev, RequestArrived):
            out.arrived.setdefault(ev.request_id, ev)
        elif isinstance(ev, RequestFinished):
            out.finished[ev.request_id] = ev
        elif getattr(ev, "request_id", None) is not None \
                and getattr(ev, "block_hash", None) is not None:
            out.blocks.setdefault(ev.request_id, []).append(
                (int(ev.block_hash), int(getattr(ev, "num_tokens", 0) or 0)))
            if event_tag(ev) == "block_stored" and ev.token_ids:
                out.stored.setdefault(ev.request_id, []).append(ev.token_ids)
            if event_tag(ev) == "block_stored" and ev.chunk_hashes is not None:
                out.stored_chunks.setdefault(ev.request_id, []).append(
                    (int(ev.num_tokens), list(ev.chunk_hashes)))
    return out


def load_kvdiag(path: Path, block_size_tokens: Optional[int] = None,
                hash_algorithm: str = "fast", read: Optional[ReadOptions] = None) -> Trace:
    """Each request is a row at its arrival; when it finishes, a second, uncounted row touches
    or inserts the full blocks of its prompt and generated tokens (engines cache both, so a
    later turn of a chat can reuse the previous answer)."""
    from kvdiag.events import eventlog

    try:
        header = eventlog.read_header(path)
    except eventlog.LogFormatError as exc:
        raise TraceFormatError(str(exc)) from None
    reqs = _read_requests(path, read or ReadOptions())
    if not reqs.arrived:
        raise TraceFormatError(f"{path}:1: expected request_arrived events in the log")
    engine_bs = header.block_size_tokens
    arrived = reqs.arrived.values()
    if all(a.token_ids is not None for a in arrived):
        bs = block_size_tokens or engine_bs or DEFAULT_BLOCK_TOKENS
        rows = _rows_from_tokens(reqs, bs, hash_algorithm)
    elif all(a.chunk_hashes is not None for a in arrived):
        bs = block_size_tokens or engine_bs or DEFAULT_BLOCK_TOKENS
        rows = _rows_from_chunk_hashes(reqs, bs, header.content_chunk_tokens or CONTENT_CHUNK_TOKENS, path)
    else:
        if block_size_tokens not in (None, engine_bs):
            raise TraceFormatError(f"{path}:1: expected --block-size {engine_bs}: this log has "
                                   "no token ids to re-chunk, only the engine's block events")
        if not engine_bs:
            raise TraceFormatError(f"{path}:1: expected block_size_tokens in the log header")
        bs = engine_bs
        rows = _rows_from_block_events(reqs, bs)
    b = TraceBuilder(bs, "kvdiag", str(path))
    for _, _, kwargs in sorted(rows, key=lambda row: row[:2]):
        if not kwargs.get("counted", True):
            kwargs["block_tokens"] = np.zeros(len(kwargs["keys"]), np.int32)
        b.add(**kwargs)
    return b.build(bytes_per_token=header.bytes_per_token)


def _arrival_row(a, f, rows: list, keys) -> tuple[int, int, dict]:
    """The row of a request at its arrival: (time, order, :meth:`TraceBuilder.add` arguments)."""
    return (a.ts_ns, len(rows), dict(keys=keys, prompt_tokens=a.prompt_tokens, arrival_ns=a.ts_ns,
                                     finish_ns=-1 if f is None else f.ts_ns,
                                     engine_cached_tokens=_engine_cached(f)))


def _rows_from_tokens(reqs: _LogRequests, bs: int, hash_algorithm: str) -> list:
    """Rows keyed from the prompts' token ids re-chunked at ``bs``; at finish, the prompt and
    the generated tokens of the blocks the request stored (:func:`full_sequence`)."""
    rows: list[tuple[int, int, dict]] = []
    for a in reqs.arrived.values():
        f = reqs.finished.get(a.request_id)
        rows.append(_arrival_row(a, f, rows, chunk_hashes(a.token_ids, bs, algorithm=hash_algorithm)))
        if f is not None:
            seq = full_sequence(a.token_ids, reqs.stored.get(a.request_id, []))
            rows.append((f.ts_ns, len(rows), dict(
                keys=chunk_hashes(seq, bs, algorithm=hash_algorithm), prompt_tokens=0,
                counted=False)))
    return rows


def _rows_from_chunk_hashes(reqs: _LogRequests, bs: int, chunk: int, path: Path) -> list:
    """Rows keyed from each request's salted chained chunk keys, which stand for its token ids
    (``bs`` must be a multiple of the log's chunk size)."""
    if chunk != CONTENT_CHUNK_TOKENS or bs % chunk:
        raise TraceFormatError(
            f"{path}:1: expected --block-size to be a multiple of {chunk}: this log holds "
            f"hashes of {chunk}-token chunks, not token ids (record with --record-tokens "
            "to replay any block size)")
    rows: list[tuple[int, int, dict]] = []
    for a in reqs.arrived.values():
        f = reqs.finished.get(a.request_id)
        rows.append(_arrival_row(a, f, rows, keys_from_chunks(a.chunk_hashes, bs)))
        if f is not None:
            seq_keys, _ = full_sequence_chunks(a.chunk_hashes, a.prompt_tokens,
                                               reqs.stored_chunks.get(a.request_id, []))
            rows.append((f.ts_ns, len(rows), dict(
                keys=keys_from_chunks(seq_keys, bs), prompt_tokens=0, counted=False)))
    return rows


def _rows_from_block_events(reqs: _LogRequests, bs: int) -> list:
    """Rows keyed by the engine's block events at its block size ``bs``: the prompt's blocks at
    arrival, all the request's blocks at finish."""
    rows: list[tuple[int, int, dict]] = []
    for rid, a in reqs.arrived.items():
        f = reqs.finished.get(rid)
        refs = reqs.blocks.get(rid, [])
        # the prompt's blocks: leading blocks whose tokens fit in the prompt; the rest
        # hold generated tokens and are only added when the request finishes
        n_prompt = int(np.searchsorted(np.cumsum([n or bs for _, n in refs]),
                                       a.prompt_tokens, side="right"))
        keys = [k for k, _ in refs]
        rows.append(_arrival_row(a, f, rows, keys[:n_prompt]))
        if f is not None:
            rows.append((f.ts_ns, len(rows), dict(keys=keys, prompt_tokens=0,
                                                   counted=False)))
    return rows
