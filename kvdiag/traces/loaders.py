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

One module per family: :mod:`~kvdiag.traces.request_traces` (mooncake, tokens: one request a
line, streamed), :mod:`~kvdiag.traces.kv_event_traces` (vllm), :mod:`~kvdiag.traces.kvdiag_logs`
(kvdiag); :mod:`~kvdiag.traces.detect` tells them apart and :mod:`~kvdiag.traces.trace` holds
what they build. This module reads any of them.

Every line is checked where it is decoded (:mod:`kvdiag.traces.lines`; vLLM events by
:func:`kvdiag.pool.prefix_cache.schema_event`, as the live subscriber decodes them): integers within
int64 (sizes, lengths, ids non-negative), finite non-negative timestamps. Errors are
:class:`TraceFormatError` ``file:line: field: expected ...``; :class:`ReadOptions` skips bad
lines and lists them instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from kvdiag.traces.detect import FORMATS, detect_format
from kvdiag.traces.kv_event_traces import load_vllm
from kvdiag.traces.kvdiag_logs import load_kvdiag, log_events
from kvdiag.traces.lines import ReadOptions, TraceFormatError, decoded_lines
from kvdiag.traces.request_traces import load_mooncake, load_tokens, tokens_line
from kvdiag.traces.trace import Trace

__all__ = ["load_trace", "prompt_token_ids"]


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


def prompt_token_ids(path: str | Path, format: Optional[str] = None,
                     read: Optional[ReadOptions] = None) -> list[list[int]]:
    """The prompts' token ids of a kvdiag log (``request_arrived.token_ids``) or a token-id
    trace, in arrival order; other formats carry no tokens. ``read`` as in :func:`load_trace`."""
    from kvdiag.events.schema import RequestArrived

    path = Path(path)
    read = ReadOptions() if read is None else read
    fmt = format or detect_format(path)
    if fmt == "tokens":
        prompts = [req.token_ids for _, req in decoded_lines(path, tokens_line, read)]
    elif fmt == "kvdiag":
        prompts = [ev.token_ids for ev in log_events(
            path, read, lambda ev: isinstance(ev, RequestArrived) and ev.token_ids is not None)]
    else:
        raise TraceFormatError(f"{path}:1: expected a kvdiag log or token-id trace with token ids "
                               f"(a {fmt} trace has none)")
    if not prompts and fmt == "kvdiag" and log_events(
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
