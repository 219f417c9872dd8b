"""vLLM KV events recorded as JSONL (one ZMQ batch a line) replayed as requests, and the gaps in a
recorded KV-event stream (a vLLM JSONL's or a kvdiag log's ``prefix_cache_*`` events)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvdiag.events.schema import PrefixCacheCleared, PrefixCacheRemoved, PrefixCacheStored, event_tag
from kvdiag.pool.hashing import chunk_hashes
from kvdiag.pool.prefix_cache import (PrefixCacheTally, SeqGap, SeqTracker, batch_ts_ns, check_seq,
                                      event_batches, find_seq_gaps, schema_event, vllm_event_dict)
from kvdiag.traces.detect import detect_format
from kvdiag.traces.kvdiag_logs import log_events
from kvdiag.traces.lines import BadLine, ReadOptions, TraceFormatError, decode_json, decoded_lines
from kvdiag.traces.trace import DEFAULT_BLOCK_TOKENS, Trace, TraceBuilder


@dataclass
class KVEventBatch:
    """One line of a vLLM KV event JSONL, checked: its events as schema ``PrefixCache*``
    events (:func:`kvdiag.pool.prefix_cache.schema_event`, as the live subscriber decodes them)."""

    seq: Optional[int]
    ts_ns: Optional[int]
    events: list


def vllm_line(line: bytes) -> KVEventBatch:
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
        for _, batch in decoded_lines(path, vllm_line, read):
            if batch.seq is None:
                unnumbered += 1
                continue
            batches.append((batch.seq, batch.ts_ns))
        if not batches and unnumbered:
            raise TraceFormatError(f"{path}:1: expected batches with \"seq\" to find gaps in")
        return find_seq_gaps(batches)
    if fmt == "kvdiag":
        tags = {"prefix_cache_stored", "prefix_cache_removed", "prefix_cache_cleared"}
        events = log_events(path, read, lambda ev: event_tag(ev) in tags)
        return find_seq_gaps(event_batches(events))
    raise TraceFormatError(f"{path}:1: expected a vLLM KV event JSONL or a kvdiag log "
                           f"(a {fmt} trace has no sequence numbers)")


def load_vllm(path: Path, block_size_tokens: Optional[int] = None,
              hash_algorithm: str = "fast", read: Optional[ReadOptions] = None) -> Trace:
    chains: dict[int, tuple[Optional[int], list[int]]] = {}  # key -> (parent key, its tokens)
    prompts: list[tuple[list[int], Optional[int]]] = []  # (token ids, ts_ns)
    engine_bs = None
    tally, seqs = PrefixCacheTally(), SeqTracker()
    for _, batch in decoded_lines(path, vllm_line, read or ReadOptions()):
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
