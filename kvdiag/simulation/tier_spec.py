"""The tiers of a tiered what-if (:mod:`kvdiag.simulation.tiers`) as ``--tiers`` gives them:
``NAME=CAP[,BW],...``, top tier first, capacities in blocks or bytes, bandwidths in bytes/s."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


from kvdiag.simulation import _tierkernels as K
from kvdiag.events.units import BYTE_UNITS


@dataclass(frozen=True)
class Tier:
    """One tier: a name, a capacity (blocks, or bytes resolved later; both None = unbounded)
    and the bandwidth of reading it into the top tier (bytes/s; None = not given)."""

    name: str
    capacity_blocks: Optional[int] = None
    capacity_bytes: Optional[int] = None
    bandwidth_bytes_per_s: Optional[float] = None

    def resolved(self, block_bytes: Optional[int]) -> "Tier":
        """The tier with a capacity in bytes turned into whole blocks."""
        if self.capacity_bytes is None:
            return self
        if not block_bytes:
            raise ValueError(f"tier {self.name}: a capacity in bytes needs the bytes per block "
                             "(--bytes-per-token, or a kvdiag log's pool/header)")
        return Tier(self.name, self.capacity_bytes // block_bytes, None,
                    self.bandwidth_bytes_per_s)


def _amount(text: str, what: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]i?b|b)?", text.strip().lower())
    if not m:
        raise ValueError(f"expected {what}, got {text!r}")
    return float(m.group(1)) * (BYTE_UNITS[m.group(2)] if m.group(2) else 1)


def parse_tiers(spec: str) -> list[Tier]:
    """``gpu=CAP[,BW],cpu=CAP[,BW],...``, top tier first. CAP: blocks (``1000``), bytes
    (``40GiB``, ``500MB``) or ``unbounded``; BW: bytes per second (``25GB/s``, ``3e9``).
    A comma-separated item with ``=`` starts a tier; one without is the bandwidth of the
    tier before it."""
    tiers: list[dict] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        if "=" in item:
            name, cap = (s.strip() for s in item.split("=", 1))
            if not re.fullmatch(r"[A-Za-z][\w-]*", name):
                raise ValueError(f"expected a tier name like gpu, cpu or disk, got {name!r}")
            if any(t["name"] == name for t in tiers):
                raise ValueError(f"tier {name!r} is given twice")
            low = cap.lower()
            if low in ("unbounded", "inf", "none"):
                tiers.append({"name": name})
            elif re.fullmatch(r"\d+", low):
                tiers.append({"name": name, "capacity_blocks": int(low)})
            else:
                tiers.append({"name": name, "capacity_bytes": int(_amount(
                    cap, f"tier {name}: a capacity like 1000 (blocks), 40GiB or unbounded"))})
        else:
            if not tiers:
                raise ValueError(f"expected NAME=CAPACITY first, got {item!r}")
            if "bandwidth_bytes_per_s" in tiers[-1]:
                raise ValueError(f"tier {tiers[-1]['name']}: two bandwidths ({item!r})")
            bw = item[:-2] if item.lower().endswith("/s") else item
            value = _amount(bw, f"tier {tiers[-1]['name']}: a bandwidth like 25GB/s")
            if value <= 0:
                raise ValueError(f"tier {tiers[-1]['name']}: bandwidth must be > 0")
            tiers[-1]["bandwidth_bytes_per_s"] = value
    if not tiers:
        raise ValueError("expected at least one tier, e.g. gpu=1000,cpu=8000,25GB/s")
    if len(tiers) > K.MAX_TIERS:
        raise ValueError(f"at most {K.MAX_TIERS} tiers")
    return [Tier(**t) for t in tiers]
