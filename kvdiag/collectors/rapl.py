"""Host energy from Intel/AMD RAPL through the powercap interface (``/sys/class/powercap``).

Each top-level zone (``intel-rapl:0`` = ``package-0``, ``intel-rapl:1``, ...; sub-zones such
as ``core`` are inside their package and left out) has ``energy_uj``, a microjoule counter
that wraps at ``max_energy_range_uj``. Many kernels make ``energy_uj`` readable by root only
(since 2020, after the Platypus side channel), and virtual machines usually have no powercap
at all: :meth:`RaplCollector.start` says which, in one ``CollectorStatus``, and then
:meth:`sample` returns nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvdiag.events.schema import CollectorStatus, HostEnergySample

NAME = "rapl"
POWERCAP = Path("/sys/class/powercap")


class RaplCollector:
    """Reads the energy counters of the top-level RAPL zones under ``root``."""

    def __init__(self, root: Path = POWERCAP) -> None:
        self.root = Path(root)
        self.zones: list[tuple[str, Path, int | None]] = []  # (name, energy_uj path, max)

    def start(self) -> CollectorStatus:
        """Find the readable zones; the status says why energy is N/A when there are none."""
        now = time.time_ns()
        if not self.root.is_dir():
            return CollectorStatus(ts_ns=now, collector=NAME, available=False,
                                   hint=f"no {self.root} (no RAPL powercap here, e.g. a virtual machine): "
                                        "host energy and CPU tokens per joule are N/A")
        zones = sorted(p for p in self.root.glob("*rapl:*") if p.name.count(":") == 1)
        if not zones:
            return CollectorStatus(ts_ns=now, collector=NAME, available=False,
                                   hint=f"no RAPL zone under {self.root}: host energy is N/A")
        denied = []
        for z in zones:
            try:
                int((z / "energy_uj").read_text())
            except PermissionError:
                denied.append(z.name)
                continue
            except (OSError, ValueError):
                continue
            name = _read(z / "name") or z.name
            top = _read(z / "max_energy_range_uj")
            self.zones.append((name, z / "energy_uj", int(top) if top and top.isdigit() else None))
        if not self.zones:
            why = (f"{self.root}/{denied[0]}/energy_uj is readable by root only" if denied
                   else f"no readable energy_uj under {self.root}")
            return CollectorStatus(ts_ns=now, collector=NAME, available=False,
                                   hint=f"{why}: host energy and CPU tokens per joule are N/A")
        return CollectorStatus(ts_ns=now, collector=NAME, available=True,
                               hint=", ".join(n for n, _, _ in self.zones))

    def sample(self) -> list[HostEnergySample]:
        """One reading per readable zone (none when a read fails)."""
        now, out = time.time_ns(), []
        for name, path, top in self.zones:
            value = _read(path)
            if value and value.isdigit():
                out.append(HostEnergySample(ts_ns=now, domain=name, energy_uj=int(value), max_energy_uj=top))
        return out


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
