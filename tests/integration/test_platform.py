"""The hardware comparison (kvdiag/diagnosis/platform.py): tokens per joule by hand, N/A with
a reason without energy, RAPL's powercap reader, and the table in `kvdiag report`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvdiag.events import schema as s
from kvdiag.diagnosis.frames import load
from kvdiag.diagnosis.platform import platform_table
from kvdiag.collectors.rapl import RaplCollector
from kvdiag.events.eventlog import make_header
from kvdiag.events.log_writer import LogWriter

T0 = 1_700_000_000_000_000_000
SEC = 10**9


def _write(path: Path, events, host: str) -> Path:
    with LogWriter(path, make_header(engine="constructed", host=host, node=host, bytes_per_token=1024,
                                     block_size_tokens=16)) as w:
        for e in events:
            w.record(e)
    return path


def _requests(outputs):
    """Requests arriving at T0 + i s, finishing 0.5 s later with ``outputs[i]`` tokens."""
    out = []
    for i, n in enumerate(outputs):
        out.append(s.RequestArrived(ts_ns=T0 + i * SEC, request_id=f"r{i}", prompt_tokens=10))
        out.append(s.RequestFinished(ts_ns=T0 + i * SEC + SEC // 2, request_id=f"r{i}", prompt_tokens=10,
                                     output_tokens=n, e2e_ns=SEC // 2))
    return out


def test_tokens_per_joule_from_nvml_energy_equals_hand_arithmetic(tmp_path):
    # GPU 0 counter 1,000 J -> 1,250 J -> 1,600 J (readings at 0.2 s, 2.0 s, 3.8 s); GPU 1
    # 500 J -> 700 J over the same span. Requests finish at 0.5, 1.5, 2.5, 3.5 and 4.5 s.
    energy = [s.NvmlSample(ts_ns=T0 + t, device=d, energy_mj=mj) for d, pts in
              ((0, ((SEC // 5, 1_000_000), (2 * SEC, 1_250_000), (38 * SEC // 10, 1_600_000))),
               (1, ((SEC // 5, 500_000), (38 * SEC // 10, 700_000)))) for t, mj in pts]
    path = _write(tmp_path / "gpu.kvlog", _requests([30, 50, 20, 40, 99]) + energy, "gpu-host")
    logs, _ = load([path])
    row = platform_table(logs, reference=False).iloc[0]
    joules = (1600 - 1000) + (700 - 500)
    tokens = 30 + 50 + 20 + 40  # the request finishing at 4.5 s is after the last reading
    assert row["tokens_per_joule"] == pytest.approx(tokens / joules)
    assert row["energy_source"] == "NVML energy counter"
    assert row["tokens_per_s"] == pytest.approx((30 + 50 + 20 + 40 + 99) / 4.5)
    assert row["kv_bytes_per_token"] == 1024


def test_rapl_energy_counts_a_wrap_once(tmp_path):
    top = 1_000_000_000  # 1,000 J in microjoules
    readings = ((0, 900_000_000), (2 * SEC, 100_000_000), (4 * SEC, 300_000_000))  # wrapped once
    energy = [s.HostEnergySample(ts_ns=T0 + t, domain="package-0", energy_uj=uj, max_energy_uj=top)
              for t, uj in readings]
    path = _write(tmp_path / "cpu.kvlog", _requests([10, 10, 10, 10, 10]) + energy, "cpu-host")
    row = platform_table(load([path])[0], reference=False).iloc[0]
    joules = (1000 - 900) + (300 - 100) + 100  # 100 J to the wrap, 100 J after it, then 200 J
    assert row["tokens_per_joule"] == pytest.approx(40 / joules)
    assert row["energy_source"] == "RAPL"


def test_tokens_per_joule_is_na_with_the_reason_without_energy(tmp_path):
    hint = "no /sys/class/powercap (no RAPL powercap here, e.g. a virtual machine): host energy is N/A"
    status = [s.CollectorStatus(ts_ns=T0, collector="rapl", available=False, hint=hint),
              s.CollectorStatus(ts_ns=T0, collector="nvml", available=False, hint="no NVIDIA driver")]
    a = _write(tmp_path / "a.kvlog", _requests([5, 5]) + status, "cpu-a")
    b = _write(tmp_path / "b.kvlog", _requests([5, 5]), "cpu-b")
    tbl = platform_table(load([a, b])[0])
    assert list(tbl["tokens_per_joule"][:2]) == ["N/A", "N/A"]
    assert hint in tbl["energy_source"][0] and "no NVIDIA driver" in tbl["energy_source"][0]
    assert "neither NVML's energy counter nor RAPL was recorded" in tbl["energy_source"][1]
    assert list(tbl["node"][2:]) == ["article: A100", "article: H100"]  # the reference rows


def test_rapl_reader_on_this_machine_reads_or_says_why():
    """This machine's powercap: energy readings when it has readable zones, else the status
    names the reason that holds here."""
    collector = RaplCollector()
    status = collector.start()
    zones = sorted(collector.root.glob("*rapl:*")) if collector.root.is_dir() else []
    if status.available:
        assert all(e.energy_uj >= 0 for e in collector.sample())
    elif not collector.root.is_dir():
        assert status.hint.startswith(f"no {collector.root} (no RAPL powercap here")
    elif not zones:
        assert status.hint == f"no RAPL zone under {collector.root}: host energy is N/A"
    else:
        assert status.hint.endswith(": host energy and CPU tokens per joule are N/A")


@pytest.mark.parametrize("layout, hint", [
    ("missing", "no {root} (no RAPL powercap here, e.g. a virtual machine): host energy and "
                "CPU tokens per joule are N/A"),
    ("empty", "no RAPL zone under {root}: host energy is N/A"),
    ("unreadable", "no readable energy_uj under {root}: host energy and CPU tokens per joule "
                   "are N/A")])
def test_rapl_reader_says_why_it_cannot_read(tmp_path, layout, hint):
    root = tmp_path / "powercap"
    if layout != "missing":
        root.mkdir()
    if layout == "unreadable":
        (root / "intel-rapl:0").mkdir()
        (root / "intel-rapl:0" / "energy_uj").write_text("not a number\n")
    status = RaplCollector(root).start()
    assert not status.available and status.hint == hint.format(root=root)


def test_rapl_reader_reads_top_level_zones(tmp_path):
    for zone, name, uj in (("intel-rapl:0", "package-0", "123"), ("intel-rapl:0:0", "core", "7")):
        z = tmp_path / zone
        z.mkdir()
        (z / "name").write_text(name + "\n")
        (z / "energy_uj").write_text(uj + "\n")
        (z / "max_energy_range_uj").write_text("262143328850\n")
    c = RaplCollector(tmp_path)
    assert c.start().available
    [sample] = c.sample()
    assert (sample.domain, sample.energy_uj, sample.max_energy_uj) == ("package-0", 123, 262143328850)
    if os.geteuid() != 0:  # root reads files whatever their mode
        (tmp_path / "intel-rapl:0" / "energy_uj").chmod(0)
        status = RaplCollector(tmp_path).start()
        assert not status.available and "root only" in status.hint


def test_report_of_two_hosts_has_the_platform_table(tmp_path):
    from kvdiag.cli import main
    energy = [s.NvmlSample(ts_ns=T0 + t, device=0, energy_mj=mj) for t, mj in ((0, 0), (2 * SEC, 100_000))]
    a = _write(tmp_path / "a.kvlog", _requests([20, 30, 40]) + energy, "gpu-host")
    b = _write(tmp_path / "b.kvlog", _requests([5, 5]), "cpu-host")
    out = tmp_path / "r.md"
    assert main(["report", str(a), str(b), "-o", str(out)]) == 0
    text = out.read_text()
    assert "## Hardware comparison" in text
    hardware = text.split("## Hardware comparison")[1].split("\n## ")[0]
    line = next(ln for ln in hardware.splitlines() if ln.startswith("| gpu-host |"))
    assert "| 0.5 |" in line  # (20 + 30) tokens in the 100 J between the readings
    assert "article: H100" in text
