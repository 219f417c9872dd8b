"""Which format a trace file is in, from its first line of a known shape (see
:mod:`kvdiag.traces.loaders` for the formats)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import msgspec

from kvdiag.pool.prefix_cache import VLLM_TAGS
from kvdiag.traces.lines import ReadOptions, TraceFormatError, raw_lines

FORMATS = ("kvdiag", "mooncake", "tokens", "vllm")
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
        if "events" in obj or obj.get("type") in VLLM_TAGS:
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
