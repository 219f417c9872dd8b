"""Why a JSON line was refused, in one wording for every reader (logs and traces).

msgspec's validation errors (``Expected `int` >= 0 - at `$.ts_ns```) become
``ts_ns: expected int >= 0``; what its strict JSON parser can only call malformed, a ``NaN`` or
``Infinity`` literal, is read with Python's json to name its field:
``input_length: expected a finite number, found Infinity``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Optional

import msgspec

_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)


def validation_message(exc: msgspec.ValidationError) -> str:
    """msgspec's ``Expected `int` <= 5 - at `$.a[0]``` as ``a[0]: expected int <= 5``."""
    what, where = _AT.match(str(exc)).groups()
    where = (where or "").lstrip(".")
    missing = re.match(r"Object missing required field `(.*)`", what)
    if missing:
        name = (where + "." if where else "") + missing.group(1)
        return f"{name}: expected a value, found the field missing"
    what = what.replace("`", "")
    if what == "Number out of range":
        what = "expected a finite number, found one out of range"
    what = what[:1].lower() + what[1:]
    return f"{where}: {what}" if where else what


def lenient_parse(line: bytes) -> object:
    """The line as Python's json reads it (NaN and Infinity included); None if not JSON."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def non_finite_message(obj: object) -> Optional[str]:
    """``field: expected a finite number, found Infinity`` for the first NaN or infinity in
    ``obj`` (a parsed line), or None."""
    found = _non_finite(obj, "")
    if found is None:
        return None
    name, value = found
    literal = "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
    return f"{name}: expected a finite number, found {literal}" if name \
        else f"expected a finite number, found {literal}"


def _non_finite(obj, where: str) -> Optional[tuple[str, float]]:
    if isinstance(obj, float) and not math.isfinite(obj):
        return where, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else ()
    for key, value in items:
        sub = f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else key)
        found = _non_finite(value, sub)
        if found is not None:
            return found
    return None
