"""Traces of one request a line, which stream: Mooncake JSONL (``hash_ids`` of 512-token blocks)
and token-id JSONL (``token_ids`` chunked and chain-hashed at any block size)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import msgspec
import numpy as np

from kvdiag.events.schema import Count
from kvdiag.pool.hashing import chunk_hashes
from kvdiag.traces.detect import detect_format
from kvdiag.traces.lines import BadLine, Millis, ReadOptions, Seconds, TraceFormatError, decode_json, decoded_lines
from kvdiag.traces.trace import DEFAULT_BLOCK_TOKENS, Trace, TraceBuilder

MOONCAKE_BLOCK_TOKENS = 512


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


def tokens_line(line: bytes) -> TokensLine:
    return decode_json(line, _TOKENS)


@dataclass
class RequestRecord:
    """One request of a streamed trace: its chained block keys (int64) in prompt order."""

    keys: np.ndarray
    prompt_tokens: int
    arrival_ns: int = -1


def mooncake_records(path: Path, opts: ReadOptions) -> Iterator[RequestRecord]:
    for _, req in decoded_lines(path, mooncake_line, opts):
        yield RequestRecord(np.asarray(req.hash_ids, dtype=np.int64), req.input_length,
                            int(req.timestamp * 1_000_000))


def token_lines(path: Path, block_size_tokens: int, hash_algorithm: str = "fast",
                read: Optional[ReadOptions] = None) -> Iterator[tuple[int, TokensLine, np.ndarray]]:
    """The one reader of token-id traces: (line number, request, chained keys of its full
    blocks, ``extra_keys`` hashed into the first) for each readable line. ``replay`` and
    ``plan`` both key requests through it, so one trace is keyed the same by both."""
    for lineno, req in decoded_lines(path, tokens_line, read or ReadOptions()):
        yield lineno, req, chunk_hashes(req.token_ids, block_size_tokens,
                                        extra_keys=tuple(req.extra_keys or ()),
                                        algorithm=hash_algorithm)


def token_records(path: Path, block_size_tokens: int, hash_algorithm: str,
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
        return _mooncake_block_size(path, block_size_tokens), mooncake_records(path, read)
    if fmt == "tokens":
        bs = block_size_tokens or DEFAULT_BLOCK_TOKENS
        return bs, token_records(path, bs, hash_algorithm, read)
    raise ValueError(f"{fmt} traces are not streamed")


def _build(records: Iterable[RequestRecord], bs: int, fmt: str, path: Path) -> Trace:
    b = TraceBuilder(bs, fmt, str(path))
    for rec in records:
        b.add(rec.keys, rec.prompt_tokens, arrival_ns=rec.arrival_ns)
    return b.build()


def load_mooncake(path: Path, block_size_tokens: Optional[int] = None,
                  read: Optional[ReadOptions] = None) -> Trace:
    bs = _mooncake_block_size(path, block_size_tokens)
    return _build(mooncake_records(path, read or ReadOptions()), bs, "mooncake", path)


def load_tokens(path: Path, block_size_tokens: Optional[int] = None,
                hash_algorithm: str = "fast", read: Optional[ReadOptions] = None) -> Trace:
    bs = block_size_tokens or DEFAULT_BLOCK_TOKENS
    return _build(token_records(path, bs, hash_algorithm, read or ReadOptions()), bs,
                  "tokens", path)
