"""`kvdiag top` on every log at hand: the recorded demo logs under tests/data/demo_small/ (real
SmolLM2 on transformers' engine) and one CONSTRUCTED log (tests/tui_data.py). Each snapshot
number is checked against an independent pandas/numpy computation over the same log, and the
app replays each log to its end without a snapshot error.
"""

from pathlib import Path

import msgspec
import numpy as np
import pandas as pd
import pytest

from kvdiag.events.eventlog import iter_events, read_log
from kvdiag.live.state import LiveState
from kvdiag.events.schema import TAGS, fields_of
from kvdiag.live.replay_source import ReplaySource
from kvdiag.tui.app import KvTopApp
from kvdiag.tui.panel_base import Panel
from tui_data import write_constructed_log

DATA = Path(__file__).parent.parent / "data" / "demo_small"
RECORDED = sorted(p for p in DATA.glob("*") if p.name.endswith((".jsonl", ".jsonl.gz", ".kvlog", ".kvlog.gz")))
S = 1_000_000_000

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module", params=[*RECORDED, "constructed"], ids=lambda p: getattr(p, "name", p))
def log_path(request, tmp_path_factory):
    if request.param == "constructed":
        return write_constructed_log(tmp_path_factory.mktemp("anylog") / "constructed.jsonl", n_requests=60)
    return request.param


class Prefix:
    """The events a replay has delivered at ``now``: file order up to the first event later
    than ``now`` (a replay, like a live stream, never reorders), as pandas frames."""

    def __init__(self, path, now):
        self.events = []
        for ev in iter_events(path):
            if ev.ts_ns > now:
                break
            self.events.append(ev)

    def frame(self, tag):
        cls = TAGS[tag]
        rows = [msgspec.structs.asdict(e) for e in self.events if type(e) is cls]
        return pd.DataFrame(rows, columns=list(fields_of(cls)))


def _fold(path, fraction):
    """The state after replaying ``fraction`` of the log's time span."""
    log = read_log(path)
    lo, hi = min(int(df["ts_ns"].min()) for df in log.frames.values() if len(df)), \
        max(int(df["ts_ns"].max()) for df in log.frames.values() if len(df))
    src = ReplaySource(path, clock=lambda: 0.0)
    src.seek((lo + fraction * (hi - lo) - src.now_ns()) / S)
    state = LiveState()
    state.set_header(src.header)
    state.feed_all(src.poll())
    now = src.now_ns()
    return state, now, Prefix(path, now)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_snapshot_agrees_with_pandas(log_path, fraction):
    state, now, log = _fold(log_path, fraction)
    snap = state.snapshot(now)
    assert snap.events == len(log.events)

    fin = log.frame("request_finished")
    done = fin[fin["status"] == "finished"]
    if done["prompt_tokens"].sum():
        assert snap.sharing.engine_hit_rate == pytest.approx(
            done["cached_prompt_tokens"].sum() / done["prompt_tokens"].sum())
    assert snap.requests.finished == len(fin)

    pool = log.frame("kv_pool_sample")
    if len(pool):
        last = pool.sort_values("ts_ns", kind="stable").iloc[-1]
        assert snap.pool.blocks_used == last["blocks_used"]
        assert snap.pool.blocks_cached == last["blocks_cached"]

    latency_start = (now // S - 59) * S  # TTFT/TPOT: the last 60 one-second bins
    first = log.frame("request_first_token").drop_duplicates("request_id", keep="last").set_index("request_id")
    recent = done[done["ts_ns"] >= latency_start]
    ttft = [t if pd.notna(t) else first["ttft_ns"].get(r) for r, t in zip(recent["request_id"], recent["ttft_ns"])]
    ttft = [t / 1e6 for t in ttft if t is not None and pd.notna(t)]
    if ttft:
        assert snap.latency.ttft_p99_ms == pytest.approx(np.percentile(ttft, 99, method="inverted_cdf"))
    else:
        assert snap.latency.ttft_p99_ms is None

    procs = log.frame("process_sample")
    if len(procs):
        latest = procs.sort_values("ts_ns", kind="stable").groupby("pid").tail(1)
        latest = latest[now - latest["ts_ns"] <= 30 * S]
        assert snap.memory.host_rss_bytes == latest["rss_bytes"].sum()


def test_requests_hold_the_blocks_the_events_say(log_path):
    state, now, log = _fold(log_path, 0.5)
    snap = state.snapshot(now)
    held: dict[str, set] = {}
    for ev in log.events:
        name = type(ev).__name__
        if name in ("BlockAllocated", "PrefixHit", "BlockDeduplicated"):
            held.setdefault(ev.request_id, set()).add(ev.block_id)
        elif name == "BlockReleased":
            held.setdefault(ev.request_id, set()).discard(ev.block_id)
    for row in snap.requests.rows:
        assert set(row.block_ids) == held.get(row.request_id, set()), row.request_id


async def test_app_replays_the_whole_log(log_path):
    src = ReplaySource(log_path, speed=1e6)
    app = KvTopApp(src, interval_s=0.2)
    async with app.run_test(size=(120, 36)) as pilot:
        for _ in range(300):
            if app.snapshot is not None and app.snapshot.finished_source:
                break
            await pilot.pause(0.05)
        assert app.snapshot.finished_source and not app.error
        events = list(iter_events(log_path))
        assert app.snapshot.events == len(events)
        # the pool panel shows the log's last pool sample (by time), counted here from the log
        texts = {p.id: str(p.render()) for p in app.query(Panel)}
        pools = [e for e in events if type(e).__name__ == "KVPoolSample"]
        assert pools, "every log at hand has KV pool samples"
        last = max(pools, key=lambda e: e.ts_ns)
        assert f"{last.blocks_used}/{last.num_blocks}" in texts["poolpanel"], texts["poolpanel"]
        await pilot.press("q")
