"""Byte amounts as text, both ways: the one formatter and the one table of unit suffixes.

:func:`format_bytes` writes binary (1024-based) units; :data:`BYTE_UNITS` reads decimal
(``kb``, ``mb``, ...) and binary (``kib``, ``mib``, ...) suffixes. A leaf module: it imports
nothing from kvdiag, so any layer may use it.
"""

from __future__ import annotations

from typing import Optional

NA = "N/A"

BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
"""Bytes per unit of each lower-case suffix a capacity may be written with."""

_IEC = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_COMPACT = ("B", "K", "M", "G", "T")


def format_bytes(n: Optional[float], decimals: int = 1, *, compact: bool = False,
                 decimal_too: bool = False) -> str:
    """``n`` bytes in the largest binary unit it reaches (B, KiB ... PiB): ``1.5 MiB`` with
    ``decimals`` digits (whole bytes: ``512 B``). ``compact``: terminal cells, 3 significant
    digits and one-letter units up to T (``1.23G``, ``456M``, ``512B``). ``decimal_too``: above
    a GB, the decimal figure in brackets too (``1.00 GiB (1.1 GB)``). None: ``N/A``."""
    if n is None:
        return NA
    units = _COMPACT if compact else _IEC
    value = float(n)
    for unit in units:
        if abs(value) < 1024 or unit == units[-1]:
            break
        value /= 1024
    if compact:
        if unit == "B":
            return f"{int(n)}B"
        return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    text = f"{value:.0f} B" if unit == "B" else f"{value:.{decimals}f} {unit}"
    if decimal_too and n >= 1e12:
        text += f" ({n / 1e12:.2f} TB)"
    elif decimal_too and n >= 1e9:
        text += f" ({n / 1e9:.1f} GB)"
    return text
