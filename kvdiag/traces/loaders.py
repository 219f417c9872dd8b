"""Request traces for prefix-sharing replay: one loader per input format, auto-detected.

Every loader produces a :class:`Trace`: for each request, in arrival order, the chained keys of
its prompt's blocks (remapped to dense ids ``0..D-1``) and how many prompt tokens each block
holds. Formats:

- ``kvdiag``: a kvdiag event log. If ``request_arrived`` events carry ``token_ids``, prompts are
  re-chunked by kvdiag at any ``block_size_tokens`` (default: the log header's); otherwise each
  request's blocks are its ``prefix_hit``, ``block_stored`` (and ``block_deduplicated``)
  events, in log order, at the engine's block size. ``request_finished.cached_prompt_tokens``
  is kept as the engine's hits.
- ``mooncake``: JSONL with ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (prefix-chained 512-token blocks; the last one may be partial and still counts).
- ``tokens``: JSONL of ``{"timestamp": ..., "token_ids": [...]}`` (optional ``request_id``,
  ``extra_keys``), chunked at ``block_size_tokens`` (default 16); only full blocks get keys.
- ``vllm``: vLLM KV events recorded as JSONL, one ZMQ batch ``[ts, [event, ...]]`` (or
  ``{"seq":..., "ts":..., "events": [...]}`` as kvdiag's subscriber records it, ``seq``
  optional, or one event) a line; events as vLLM's array form
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, ...]`` or as
  objects with a ``type``. KV events carry no request ids: each ``BlockStored`` is replayed as
  one request whose prompt is its parent chain (served from cache, hence not stored again)
  followed by the stored blocks. Token ids make the prompts re-chunkable at any block size.
  The notes count stored, duplicate, removed and cleared blocks
  (:class:`kvdiag.pool.prefix_cache.PrefixCacheTally`); :func:`kv_event_gaps` finds missing seqs.

Every line is checked where it is decoded (:mod:`kvdiag.traces.lines`; vLLM events by
:func:`kvdiag.pool.prefix_cache.schema_event`, as the live subscriber decodes them): integers within
int64 (sizes, lengths, ids non-negative), finite non-negative timestamps. Errors are
:class:`TraceFormatError` ``file:line: field: expected ...``; :class:`ReadOptions` skips bad
lines and lists them instead.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import msgspec
import numpy as np
import pandas as pd

from kvdiag.pool.hashing import (CONTENT_CHUNK_TOKENS, chunk_hashes, full_sequence_chunks,
                                    keys_from_chunks)
from kvdiag.traces.lines import (BadLine, Millis, ReadOptions, Seconds,
                                         TraceFormatError, decode_json, decoded_lines, raw_lines)
from kvdiag.pool.hit_rate import counts_toward_hit_rate
from kvdiag.pool.prefix_cache import (VLLM_TAGS, PrefixCacheTally, SeqGap, SeqTracker, batch_ts_ns,
                                 check_seq, event_batches, find_seq_gaps, schema_event,
                                 vllm_event_dict)
from kvdiag.events.schema import (Count, PrefixCacheCleared, PrefixCacheRemoved, PrefixCacheStored,
                           event_tag)

FORMATS = ("kvdiag", "mooncake", "tokens", "vllm")
MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size


@dataclass
class Trace:
    """Requests as block-reference sequences (CSR layout over dense block ids).

    ``block_ids[offsets[r]:offsets[r+1]]`` are request ``r``'s blocks in prompt order;
    ``block_tokens[i]`` = prompt tokens the block at reference ``i`` holds
    (``min(block_size, remaining prompt)``), which a hit on it saves.
    """

    block_ids: np.ndarray  # int32 [refs]
    offsets: np.ndarray  # int64 [requests + 1]
    block_tokens: np.ndarray  # int32 [refs]
    prompt_tokens: np.ndarray  # int64 [requests]
    num_blocks: int  # distinct blocks
    block_size_tokens: int
    format: str
    source: str = ""
    arrival_ns: Optional[np.ndarray] = None  # int64 [requests]
    finish_ns: Optional[np.ndarray] = None  # int64 [requests], -1 unknown
    engine_cached_tokens: Optional[np.ndarray] = None  # int64 [requests], -1 unknown or not counted
    bytes_per_token: Optional[int] = None
    notes: list[str] = field(default_factory=list)
    # rows that are requests (1) or the blocks a request adds when it finishes (0: prompt and
    # generated tokens, as engines cache them); None = every row is a request
    counted: Optional[np.ndarray] = None  # uint8 [rows]

    @property
    def rows(self) -> int:
        return len(self.prompt_tokens)

    @property
    def counted_rows(self) -> np.ndarray:
        return np.ones(self.rows, np.uint8) if self.counted is None else self.counted

    @property
    def requests(self) -> int:
        return self.rows if self.counted is None else int(self.counted.sum())

    @property
    def block_refs(self) -> int:
        """Block references of requests' prompts (not the blocks added at finish)."""
        if self.counted is None:
            return len(self.block_ids)
        return int((np.diff(self.offsets) * self.counted).sum())

    def requests_only(self) -> "Trace":
        """The trace without the rows of blocks added at finish."""
        if self.counted is None:
            return self
        keep = np.nonzero(self.counted)[0]
        lens = np.diff(self.offsets)[keep]
        take = np.concatenate([np.arange(self.offsets[r], self.offsets[r + 1]) for r in keep]) \
            if len(keep) else np.zeros(0, np.int64)
        pick = (lambda a: None if a is None else a[keep])
        return Trace(self.block_ids[take], np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                     self.block_tokens[take], self.prompt_tokens[keep], self.num_blocks,
                     self.block_size_tokens, self.format, self.source, pick(self.arrival_ns),
                     pick(self.finish_ns), pick(self.engine_cached_tokens), self.bytes_per_token,
                     list(self.notes))

    def plain(self) -> "Trace":
        """Plain cache semantics: every block reference becomes a request of one block, so a
        lookup no longer depends on the blocks before it (what libCacheSim simulates)."""
        n = self.block_refs
        return Trace(self.block_ids, np.arange(n + 1, dtype=np.int64), self.block_tokens,
                     self.block_tokens.astype(np.int64), self.num_blocks,
                     self.block_size_tokens, self.format + "+plain", self.source,
                     bytes_per_token=self.bytes_per_token)

    def repeated(self, times: int) -> "Trace":
        """The trace played ``times`` times back to back (same blocks)."""
        n = self.block_refs
        offsets = np.concatenate([self.offsets[:-1] + k * n for k in range(times)] + [[n * times]])
        return Trace(np.tile(self.block_ids, times), offsets.astype(np.int64),
                     np.tile(self.block_tokens, times), np.tile(self.prompt_tokens, times),
                     self.num_blocks, self.block_size_tokens, self.format, self.source,
                     bytes_per_token=self.bytes_per_token)


class TraceBuilder:
    """Accumulates requests (raw 64-bit keys) compactly; :meth:`build` remaps keys to dense ids."""

    def __init__(self, block_size_tokens: int, fmt: str, source: str) -> None:
        self.block_size_tokens = block_size_tokens
        self.format = fmt
        self.source = source
        self._keys = array("q")
        self._tokens = array("i")
        self._offsets = array("q", [0])
        self._prompt = array("q")
        self._arrival = array("q")
        self._finish = array("q")
        self._cached = array("q")
        self._counted = array("B")

    def add(self, keys, prompt_tokens: int, *, block_tokens=None, arrival_ns: int = -1,
            finish_ns: int = -1, engine_cached_tokens: int = -1, counted: bool = True) -> None:
        """One request: its block keys in prompt order. ``block_tokens`` defaults to
        ``min(block_size, remaining prompt)`` per block. ``counted=False``: not a request but
        the blocks one adds to the cache when it finishes (no lookup, no tokens)."""
        keys = np.asarray(keys, dtype=np.int64)
        if block_tokens is None:
            starts = np.arange(len(keys), dtype=np.int64) * self.block_size_tokens
            block_tokens = np.clip(prompt_tokens - starts, 0, self.block_size_tokens)
        self._keys.frombytes(keys.tobytes())
        self._tokens.frombytes(np.asarray(block_tokens, dtype=np.int32).tobytes())
        self._offsets.append(self._offsets[-1] + len(keys))
        self._prompt.append(int(prompt_tokens))
        self._arrival.append(int(arrival_ns))
        self._finish.append(int(finish_ns))
        self._cached.append(int(engine_cached_tokens))
        self._counted.append(1 if counted else 0)

    def build(self, bytes_per_token: Optional[int] = None) -> Trace:
        keys = np.frombuffer(self._keys, dtype=np.int64)
        if len(keys):
            codes, uniques = pd.factorize(keys, sort=False)
        else:
            codes, uniques = np.empty(0, np.int64), []
        arrival = np.frombuffer(self._arrival, dtype=np.int64).copy()
        finish = np.frombuffer(self._finish, dtype=np.int64).copy()
        cached = np.frombuffer(self._cached, dtype=np.int64).copy()
        counted = np.frombuffer(self._counted, dtype=np.uint8).copy()
        return Trace(
            block_ids=codes.astype(np.int32),
            offsets=np.frombuffer(self._offsets, dtype=np.int64).copy(),
            block_tokens=np.frombuffer(self._tokens, dtype=np.int32).copy(),
            prompt_tokens=np.frombuffer(self._prompt, dtype=np.int64).copy(),
            num_blocks=len(uniques),
            block_size_tokens=self.block_size_tokens,
            format=self.format,
            source=self.source,
            arrival_ns=arrival if (arrival >= 0).any() else None,
            finish_ns=finish if (finish >= 0).any() else None,
            engine_cached_tokens=cached if (cached >= 0).any() else None,
            bytes_per_token=bytes_per_token,
            counted=None if counted.all() else counted,
        )


# ---------------------------------------------------------------- lines of each format


class MooncakeLine(msgspec.Struct):
    """One Mooncake request: ``timestamp`` in ms, lengths in tokens, ``hash_ids`` ids of
    512-token blocks."""

    timestamp: Millis
    input_length: Count
    hash_ids: list[Count]
    output_length: Optional[Count] = None


class TokensLine(msgspec.Struct):
    """One token-id request: ``timestamp`` in seconds (optional), ``token_ids``, optional
    ``extra_keys`` (any JSON, hashed into the first block's key) and ``output_tokens`` (the
    planner's output length)."""

    token_ids: list[Count]
    timestamp: Optional[Seconds] = None
    extra_keys: Optional[list] = None
    output_tokens: Optional[Count] = None


_MOONCAKE = msgspec.json.Decoder(MooncakeLine)
_TOKENS = msgspec.json.Decoder(TokensLine)


def mooncake_line(line: bytes) -> MooncakeLine:
    req = decode_json(line, _MOONCAKE)
    want = -(-req.input_length // MOONCAKE_BLOCK_TOKENS)
    if len(req.hash_ids) != want:
        raise BadLine(f"hash_ids: expected ceil(input_length/512) = {want} ids, got "
                      f"{len(req.hash_ids)}")
    return req


def _tokens_line(line: bytes) -> TokensLine:
    return decode_json(line, _TOKENS)


# ---------------------------------------------------------------- detection

_DETECT_LINES = 100  # lines detection looks at for the first recognisable one


def _shape(line: bytes) -> Optional[str]:
    """The format one line looks like (None: not JSON, or no format's shape)."""
    try:
        obj = msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError):
        try:
            obj = json.loads(line)  # NaN/Infinity: still the shape of a format
        except (ValueError, RecursionError):
            return None
    if isinstance(obj, dict):
        if "schema_version" in obj or obj.get("type") == "log_header" or "header" in obj:
            return "kvdiag"
        if "hash_ids" in obj:
            return "mooncake"
        if "token_ids" in obj and "type" not in obj:
            return "tokens"
        if "events" in obj or obj.get("type") in _VLLM_TAGS:
            return "vllm"
    if isinstance(obj, list) and len(obj) == 2 and isinstance(obj[1], list):
        return "vllm"
    return None


def detect_format(path: str | Path) -> str:
    """Guess a trace's format from its first line of a known shape (see the module docstring;
    unreadable lines before it are left to the reader to skip or reject)."""
    path = Path(path)
    first = None
    for n, (lineno, line, _) in enumerate(raw_lines(path, ReadOptions(partial=True))):
        first = first or lineno
        fmt = _shape(line)
        if fmt is not None:
            return fmt
        if n + 1 >= _DETECT_LINES:
            break
    if first is None:
        raise TraceFormatError(f"{path}:1: expected at least one request, found an empty file")
    raise TraceFormatError(
        f"{path}:{first}: expected a kvdiag log header, a Mooncake request (\"hash_ids\"), "
        "a token-id request (\"token_ids\") or a vLLM KV event batch")


# ---------------------------------------------------------------- loaders


@dataclass
class RequestRecord:
    """One request of a streamed trace: its chained block keys (int64) in prompt order."""

    keys: np.ndarray
    prompt_tokens: int
    arrival_ns: int = -1


def _mooncake_records(path: Path, opts: ReadOptions) -> Iterator[RequestRecord]:
    for _, req in decoded_lines(path, mooncake_line, opts):
        yield RequestRecord(np.asarray(req.hash_ids, dtype=np.int64), req.input_length,
                            int(req.timestamp * 1_000_000))


def token_lines(path: Path, block_size_tokens: int, hash_algorithm: str = "fast",
                read: Optional[ReadOptions] = None) -> Iterator[tuple[int, TokensLine, np.ndarray]]:
    """The one reader of token-id traces: (line number, request, chained keys of its full
    blocks, ``extra_keys`` hashed into the first) for each readable line. ``replay`` and
    ``plan`` both key requests through it, so one trace is keyed the same by both."""
    for lineno, req in decoded_lines(path, _tokens_line, read or ReadOptions()):
        yield lineno, req, chunk_hashes(req.token_ids, block_size_tokens,
                                        extra_keys=tuple(req.extra_keys or ()),
                                        algorithm=hash_algorithm)


def _token_records(path: Path, block_size_tokens: int, hash_algorithm: str,
                   opts: ReadOptions) -> Iterator[RequestRecord]:
    for _, req, keys in token_lines(path, block_size_tokens, hash_algorithm, opts):
        ts = req.timestamp
        yield RequestRecord(keys, len(req.token_ids), -1 if ts is None else int(ts * 1e9))


def _mooncake_block_size(path: Path, block_size_tokens: Optional[int]) -> int:
    if block_size_tokens not in (None, MOONCAKE_BLOCK_TOKENS):
        raise TraceFormatError(f"{path}:1: expected --block-size {MOONCAKE_BLOCK_TOKENS}: Mooncake "
                               "traces carry only hashes of 512-token blocks, not tokens")
    return MOONCAKE_BLOCK_TOKENS


def iter_requests(path: str | Path, format: Optional[str] = None,
                  block_size_tokens: Optional[int] = None,
                  hash_algorithm: str = "fast",
                  read: Optional[ReadOptions] = None) -> tuple[int, Iterator[RequestRecord]]:
    """(block size, requests streamed one by one) of a Mooncake or token-id trace: memory for
    a replay then grows with distinct blocks, not with the trace. Other formats need the whole
    file (requests are rebuilt from events): use :func:`load_trace`. ``read``: how bad lines
    are treated (default: the first raises TraceFormatError)."""
    path = Path(path)
    fmt = format or detect_format(path)
    read = ReadOptions() if read is None else read
    if fmt == "mooncake":
        return _mooncake_block_size(path, block_size_tokens), _mooncake_records(path, read)
    if fmt == "tokens":
        bs = block_size_tokens or DEFAULT_BLOCK_TOKENS
        return bs, _token_records(path, bs, hash_algorithm, read)
    raise ValueError(f"{fmt} traces are not streamed")


def _build(records: Iterable[RequestRecord], bs: int, fmt: str, path: Path) -> Trace:
    b = TraceBuilder(bs, fmt, str(path))
    for rec in records:
        b.add(rec.keys, rec.prompt_tokens, arrival_ns=rec.arrival_ns)
    return b.build()


def load_mooncake(path: Path, block_size_tokens: Optional[int] = None,
                  read: Optional[ReadOptions] = None) -> Trace:
    bs = _mooncake_block_size(path, block_size_tokens)
    return _build(_mooncake_records(path, read or ReadOptions()), bs, "mooncake", path)


def load_tokens(path: Path, block_size_tokens: Optional[int] = None,
                hash_algorithm: str = "fast", read: Optional[ReadOptions] = None) -> Trace:
    bs = block_size_tokens or DEFAULT_BLOCK_TOKENS
    return _build(_token_records(path, bs, hash_algorithm, read or ReadOptions()), bs,
                  "tokens", path)


_VLLM_TAGS = VLLM_TAGS


@dataclass
class KVEventBatch:
    """One line of a vLLM KV event JSONL, checked: its events as schema ``PrefixCache*``
    events (:func:`kvdiag.pool.prefix_cache.schema_event`, as the live subscriber decodes them)."""

    seq: Optional[int]
    ts_ns: Optional[int]
    events: list


def _vllm_line(line: bytes) -> KVEventBatch:
    obj = decode_json(line)
    ts, seq = None, None
    if isinstance(obj, list) and len(obj) == 2 and isinstance(obj[1], list):
        ts, raw = obj
    elif isinstance(obj, dict) and "events" in obj:
        ts, raw, seq = obj.get("ts"), obj["events"], obj.get("seq")
        if not isinstance(raw, list):
            raise BadLine("events: expected a list of vLLM KV events")
    elif isinstance(obj, dict):
        raw = [obj]
    else:
        raise BadLine("expected a vLLM KV event batch [ts, [events]] or {\"seq\", \"ts\", "
                      "\"events\"}")
    try:
        ts_ns = None if ts is None else batch_ts_ns(ts)
        seq = None if seq is None else check_seq(seq)
        events = [schema_event(vllm_event_dict(ev), ts_ns or 0, seq or 0) for ev in raw]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadLine(str(exc)) from None
    for ev in events:
        if isinstance(ev, PrefixCacheStored):
            want = ev.block_size_tokens * len(ev.block_hashes)
            if len(ev.token_ids) != want:
                raise BadLine(f"BlockStored.token_ids: expected len(token_ids) = block_size x "
                              f"len(block_hashes) = {want}, got {len(ev.token_ids)}")
    return KVEventBatch(seq, ts_ns, events)


def kv_event_gaps(path: str | Path, format: Optional[str] = None,
                  read: Optional[ReadOptions] = None) -> list[SeqGap]:
    """Batches missing from a recorded KV event stream, by their sequence numbers
    (:func:`kvdiag.pool.prefix_cache.find_seq_gaps`): a vLLM JSONL whose lines carry ``seq`` (as
    ``kvdiag.collectors.vllm_kv_events`` records them), or a kvdiag log's ``prefix_cache_*``
    events. A JSONL without any ``seq`` has no gaps to find: TraceFormatError. A skipped
    (unreadable) line counts as missing."""
    path = Path(path)
    read = ReadOptions() if read is None else read
    fmt = format or detect_format(path)
    if fmt == "vllm":
        batches, unnumbered = [], 0
        for _, batch in decoded_lines(path, _vllm_line, read):
            if batch.seq is None:
                unnumbered += 1
                continue
            batches.append((batch.seq, batch.ts_ns))
        if not batches and unnumbered:
            raise TraceFormatError(f"{path}:1: expected batches with \"seq\" to find gaps in")
        return find_seq_gaps(batches)
    if fmt == "kvdiag":
        tags = {"prefix_cache_stored", "prefix_cache_removed", "prefix_cache_cleared"}
        events = _log_events(path, read, lambda ev: event_tag(ev) in tags)
        return find_seq_gaps(event_batches(events))
    raise TraceFormatError(f"{path}:1: expected a vLLM KV event JSONL or a kvdiag log "
                           f"(a {fmt} trace has no sequence numbers)")


def load_vllm(path: Path, block_size_tokens: Optional[int] = None,
              hash_algorithm: str = "fast", read: Optional[ReadOptions] = None) -> Trace:
    chains: dict[int, tuple[Optional[int], list[int]]] = {}  # key -> (parent key, its tokens)
    prompts: list[tuple[list[int], Optional[int]]] = []  # (token ids, ts_ns)
    engine_bs = None
    tally, seqs = PrefixCacheTally(), SeqTracker()
    for _, batch in decoded_lines(path, _vllm_line, read or ReadOptions()):
        if batch.seq is not None and seqs.observe(batch.seq)[0] == "restart":
            tally.restarted()
        for ev in batch.events:
            if isinstance(ev, PrefixCacheCleared):
                tally.cleared()
                continue
            if isinstance(ev, PrefixCacheRemoved):
                tally.removed(ev.block_hashes, ev.medium, ev.group_idx)
                continue
            hashes, parent, tokens = ev.block_hashes, ev.parent_hash, ev.token_ids
            bs = ev.block_size_tokens
            engine_bs = engine_bs or bs
            tally.stored(hashes, ev.medium, ev.group_idx)
            parts, seen, p = [], set(), parent
            while p is not None and p in chains and p not in seen:  # a cycle ends the chain
                seen.add(p)
                p, toks = chains[p]
                parts.append(toks)
            prefix = [t for toks in reversed(parts) for t in toks]
            for i, h in enumerate(hashes):
                chains[h] = (parent if i == 0 else hashes[i - 1], tokens[i * bs:(i + 1) * bs])
            prompts.append((prefix + tokens, batch.ts_ns))
    bs = block_size_tokens or engine_bs or DEFAULT_BLOCK_TOKENS
    b = TraceBuilder(bs, "vllm", str(path))
    for tokens, ts_ns in prompts:
        b.add(chunk_hashes(tokens, bs, algorithm=hash_algorithm), len(tokens),
              arrival_ns=-1 if ts_ns is None else ts_ns)
    trace = b.build()
    trace.notes.append("vLLM KV events: each BlockStored is one request (its parent chain + "
                       "the stored blocks); requests served wholly from cache are not visible")
    c = tally.counts
    trace.notes.append(f"vLLM KV events: {c.stored_blocks} blocks stored, {c.duplicate_stores} of "
                       f"them already cached (duplicate stores), {c.removed_blocks} removed, "
                       f"{c.clears} clears")
    return trace


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


def _log_events(path: Path, read: ReadOptions, keep: Callable[[object], bool]) -> list:
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


def load_kvdiag(path: Path, block_size_tokens: Optional[int] = None,
                hash_algorithm: str = "fast", read: Optional[ReadOptions] = None) -> Trace:
    """Each request is a row at its arrival; when it finishes, a second, uncounted row touches
    or inserts the full blocks of its prompt and generated tokens (engines cache both, so a
    later turn of a chat can reuse the previous answer)."""
    from kvdiag.events import eventlog
    from kvdiag.events.schema import RequestArrived, RequestFinished

    try:
        header = eventlog.read_header(path)
    except eventlog.LogFormatError as exc:
        raise TraceFormatError(str(exc)) from None
    arrived: dict[str, RequestArrived] = {}
    blocks: dict[str, list[tuple[int, int]]] = {}  # (chained key, tokens in block)
    stored: dict[str, list[list[int]]] = {}
    stored_chunks: dict[str, list[tuple[int, list[int]]]] = {}  # hashes mode
    finished: dict[str, RequestFinished] = {}
    wanted = (RequestArrived, RequestFinished)
    for ev in _log_events(path, read or ReadOptions(),
                          lambda ev: isinstance(ev, wanted) or event_tag(ev) in _BLOCK_REF_TAGS):
        if isinstance(ev, RequestArrived):
            arrived.setdefault(ev.request_id, ev)
        elif isinstance(ev, RequestFinished):
            finished[ev.request_id] = ev
        elif getattr(ev, "request_id", None) is not None \
                and getattr(ev, "block_hash", None) is not None:
            blocks.setdefault(ev.request_id, []).append(
                (int(ev.block_hash), int(getattr(ev, "num_tokens", 0) or 0)))
            if event_tag(ev) == "block_stored" and ev.token_ids:
                stored.setdefault(ev.request_id, []).append(ev.token_ids)
            if event_tag(ev) == "block_stored" and ev.chunk_hashes is not None:
                stored_chunks.setdefault(ev.request_id, []).append(
                    (int(ev.num_tokens), list(ev.chunk_hashes)))
    if not arrived:
        raise TraceFormatError(f"{path}:1: expected request_arrived events in the log")
    engine_bs = header.block_size_tokens
    rows: list[tuple[int, int, dict]] = []  # (time, order, TraceBuilder.add kwargs)
    if all(a.token_ids is not None for a in arrived.values()):
        bs = block_size_tokens or engine_bs or DEFAULT_BLOCK_TOKENS
        for a in arrived.values():
            f = finished.get(a.request_id)
            rows.append((a.ts_ns, len(rows), dict(
                keys=chunk_hashes(a.token_ids, bs, algorithm=hash_algorithm),
                prompt_tokens=a.prompt_tokens, arrival_ns=a.ts_ns,
                finish_ns=-1 if f is None else f.ts_ns,
                engine_cached_tokens=_engine_cached(f))))
            if f is not None:
                seq = full_sequence(a.token_ids, stored.get(a.request_id, []))
                rows.append((f.ts_ns, len(rows), dict(
                    keys=chunk_hashes(seq, bs, algorithm=hash_algorithm), prompt_tokens=0,
                    counted=False)))
    elif all(a.chunk_hashes is not None for a in arrived.values()):
        # hashes mode: each request's salted chained chunk keys stand for its token ids
        bs = block_size_tokens or engine_bs or DEFAULT_BLOCK_TOKENS
        chunk = header.content_chunk_tokens or CONTENT_CHUNK_TOKENS
        if chunk != CONTENT_CHUNK_TOKENS or bs % chunk:
            raise TraceFormatError(
                f"{path}:1: expected --block-size to be a multiple of {chunk}: this log holds "
                f"hashes of {chunk}-token chunks, not token ids (record with --record-tokens "
                "to replay any block size)")
        for a in arrived.values():
            f = finished.get(a.request_id)
            rows.append((a.ts_ns, len(rows), dict(
                keys=keys_from_chunks(a.chunk_hashes, bs),
                prompt_tokens=a.prompt_tokens, arrival_ns=a.ts_ns,
                finish_ns=-1 if f is None else f.ts_ns,
                engine_cached_tokens=_engine_cached(f))))
            if f is not None:
                seq_keys, _ = full_sequence_chunks(a.chunk_hashes, a.prompt_tokens,
                                                   stored_chunks.get(a.request_id, []))
                rows.append((f.ts_ns, len(rows), dict(
                    keys=keys_from_chunks(seq_keys, bs), prompt_tokens=0, counted=False)))
    else:
        if block_size_tokens not in (None, engine_bs):
            raise TraceFormatError(f"{path}:1: expected --block-size {engine_bs}: this log has "
                                   "no token ids to re-chunk, only the engine's block events")
        if not engine_bs:
            raise TraceFormatError(f"{path}:1: expected block_size_tokens in the log header")
        bs = engine_bs
        for rid, a in arrived.items():
            f = finished.get(rid)
            refs = blocks.get(rid, [])
            # the prompt's blocks: leading blocks whose tokens fit in the prompt; the rest
            # hold generated tokens and are only added when the request finishes
            n_prompt = int(np.searchsorted(np.cumsum([n or bs for _, n in refs]),
                                           a.prompt_tokens, side="right"))
            keys = [k for k, _ in refs]
            rows.append((a.ts_ns, len(rows), dict(
                keys=keys[:n_prompt], prompt_tokens=a.prompt_tokens, arrival_ns=a.ts_ns,
                finish_ns=-1 if f is None else f.ts_ns,
                engine_cached_tokens=_engine_cached(f))))
            if f is not None:
                rows.append((f.ts_ns, len(rows), dict(keys=keys, prompt_tokens=0,
                                                       counted=False)))
    b = TraceBuilder(bs, "kvdiag", str(path))
    for _, _, kwargs in sorted(rows, key=lambda row: row[:2]):
        if not kwargs.get("counted", True):
            kwargs["block_tokens"] = np.zeros(len(kwargs["keys"]), np.int32)
        b.add(**kwargs)
    return b.build(bytes_per_token=header.bytes_per_token)


def load_trace(path: str | Path, format: Optional[str] = None,
               block_size_tokens: Optional[int] = None, hash_algorithm: str = "fast",
               read: Optional[ReadOptions] = None) -> Trace:
    """Read a trace of any supported format (auto-detected unless ``format`` is given).
    ``read``: how bad lines are treated (default: the first raises TraceFormatError; with
    ``ReadOptions(strict=False)`` they are skipped and listed in its ``problems``)."""
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}:0: expected an existing trace file")
    fmt = format or detect_format(path)
    if fmt not in FORMATS:
        raise TraceFormatError(f"{path}:0: expected --format to be one of {', '.join(FORMATS)}")
    if block_size_tokens is not None and block_size_tokens <= 0:
        raise TraceFormatError(f"{path}:0: expected a positive block size")
    read = ReadOptions() if read is None else read
    loaders: dict[str, Callable[..., Trace]] = {
        "mooncake": lambda: load_mooncake(path, block_size_tokens, read),
        "tokens": lambda: load_tokens(path, block_size_tokens, hash_algorithm, read),
        "vllm": lambda: load_vllm(path, block_size_tokens, hash_algorithm, read),
        "kvdiag": lambda: load_kvdiag(path, block_size_tokens, hash_algorithm, read),
    }
    return loaders[fmt]()


def trace_from_blocks(requests: list[list[int]], block_size_tokens: int = 1,
                      prompt_tokens: Optional[list[int]] = None, fmt: str = "blocks") -> Trace:
    """A trace from per-request lists of block keys (prompt = whole blocks unless given)."""
    b = TraceBuilder(block_size_tokens, fmt, "")
    for i, keys in enumerate(requests):
        n = len(keys) * block_size_tokens if prompt_tokens is None else prompt_tokens[i]
        b.add(np.asarray(keys, dtype=np.int64), n)
    return b.build()


def trace_from_tokens(requests: list[list[int]], block_size_tokens: int,
                      hash_algorithm: str = "fast") -> Trace:
    """A trace from per-request token ids, chunked and chain-hashed like the ``tokens`` format."""
    b = TraceBuilder(block_size_tokens, "tokens", "")
    for tokens in requests:
        b.add(chunk_hashes(tokens, block_size_tokens, algorithm=hash_algorithm), len(tokens))
    return b.build()


def prompt_token_ids(path: str | Path, format: Optional[str] = None,
                     read: Optional[ReadOptions] = None) -> list[list[int]]:
    """The prompts' token ids of a kvdiag log (``request_arrived.token_ids``) or a token-id
    trace, in arrival order; other formats carry no tokens. ``read`` as in :func:`load_trace`."""
    from kvdiag.events.schema import RequestArrived

    path = Path(path)
    read = ReadOptions() if read is None else read
    fmt = format or detect_format(path)
    if fmt == "tokens":
        prompts = [req.token_ids for _, req in decoded_lines(path, _tokens_line, read)]
    elif fmt == "kvdiag":
        prompts = [ev.token_ids for ev in _log_events(
            path, read, lambda ev: isinstance(ev, RequestArrived) and ev.token_ids is not None)]
    else:
        raise TraceFormatError(f"{path}:1: expected a kvdiag log or token-id trace with token ids "
                               f"(a {fmt} trace has none)")
    if not prompts and fmt == "kvdiag" and _log_events(
            path, ReadOptions(strict=False, partial=True),
            lambda ev: isinstance(ev, RequestArrived) and ev.chunk_hashes is not None):
        raise TraceFormatError(
            f"{path}:1: expected token ids, found only hashes of the prompts: this analysis needs "
            "a log recorded with --record-tokens (or KVDIAG_RECORD_TOKENS=1)")
    if not prompts:
        raise TraceFormatError(f"{path}:1: expected " + (
            "request_arrived events with token_ids" if fmt == "kvdiag" else "token-id requests")
            + (f", found only unreadable lines (first: {read.problems[0]})"
               if read.problems else ""))
    return prompts
