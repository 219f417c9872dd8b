"""`kvdiag top`'s Textual app driven by Pilot, and SVG snapshots of its main screen.

Replays CONSTRUCTED TEST DATA (tests/tui_data.py) with a frozen replay clock, so every
snapshot is the same picture at the same log position.
"""

import asyncio
import threading

import pytest

from kvdiag.events.eventlog import iter_events, read_log
from kvdiag.live.replay_source import ReplaySource
from kvdiag.tui.app import KvTopApp, TextScreen
from kvdiag.tui.panel_base import Panel
from kvdiag.tui.panels_alerts import AlertsPanel
from kvdiag.tui.panels_memory import MemoryPanel
from kvdiag.tui.panels_requests import RequestsPanel
from kvdiag.tui.panels_shadow import LocalityPanel
from tui_data import write_constructed_log

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("topapp")
    return {"full": write_constructed_log(d / "full.jsonl"),
            "bare": write_constructed_log(d / "bare.jsonl", gpu=False, shadow=False)}


def make_app(path, seconds=40.0, tmp_path=None, **kwargs):
    src = ReplaySource(path, clock=lambda: 0.0)
    src.seek(seconds)
    return KvTopApp(src, interval_s=kwargs.pop("interval_s", 1.0), output_dir=tmp_path or ".",
                    wall_clock=lambda: 1_790_000_000.0, **kwargs)


async def wait_snapshots(pilot, app, n=1):
    """Until ``n`` snapshots were shown and the last one carries the rules' first verdicts."""
    for _ in range(500):
        if app.snapshots_built >= n and app.rule_runs and app.snapshot.alerts:
            await pilot.pause()
            return
        await pilot.pause(0.02)
    raise AssertionError("no snapshot with the rules' verdicts arrived")


def count_ticks(app) -> None:
    """Counts the app's finished periodic ticks in ``app.periodic_ticks`` (forced ones are not
    counted: they are the keys' workers)."""
    app.periodic_ticks = 0
    lock, tick = threading.Lock(), app.tick

    def counted(force: bool = False) -> None:
        try:
            tick(force=force)
        finally:
            if not force:
                with lock:
                    app.periodic_ticks += 1

    app.tick = counted


async def wait_until(pilot, condition, what: str, timeout_s: float = 10.0) -> None:
    """Until ``condition()`` holds (fails after ``timeout_s``), then until the app has handled
    what the worker threads posted before that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await pilot.pause(0.02)
    await asyncio.sleep(0)  # a thread's post (call_soon_threadsafe) is queued before pause()'s marker
    await pilot.pause()


async def wait_periodic_ticks(pilot, app, n: int) -> None:
    """Until ``n`` more periodic ticks have ended and their snapshots (if any) are handled: with
    ``n`` >= 2, one whole tick began after this call."""
    done = app.periodic_ticks + n
    await wait_until(pilot, lambda: app.periodic_ticks >= done, f"{n} periodic ticks")


def panel_text(app, cls) -> str:
    return str(app.query_one(cls).render())


async def test_panels_show_snapshot_numbers(logs):
    app = make_app(logs["full"])
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_snapshots(pilot, app)
        snap = app.snapshot
        pool = panel_text(app, "#poolpanel")
        assert f"{snap.pool.blocks_used}/{snap.pool.num_blocks}" in pool
        sharing = panel_text(app, "#sharingpanel")
        assert f"{snap.sharing.engine_hit_rate * 100:.1f}%" in sharing
        top = snap.requests.rows[0]
        assert top.request_id in panel_text(app, RequestsPanel)
        assert "N/A" not in panel_text(app, MemoryPanel)


async def test_keys_pause_focus_detail_help_quit(logs):
    app = make_app(logs["full"], interval_s=0.2)
    count_ticks(app)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_snapshots(pilot, app)
        assert isinstance(app.focused, MemoryPanel)
        await pilot.press("tab")
        assert app.focused.id == "poolpanel"
        await pilot.press("right", "right")
        assert app.focused.id == "sharingpanel"
        await pilot.press("left")
        assert app.focused.id == "latencypanel"

        await pilot.press("p")
        await wait_until(pilot, lambda: app.snapshot.paused, "the paused snapshot")
        # the key's worker is done, and so is a periodic tick that began before the pause (it may
        # post one late snapshot): every tick from here on began while paused
        forced = [w for w in app.workers if w.group == "force"]
        if forced:  # (none: all are done; wait_for_complete([]) would wait for every worker)
            await app.workers.wait_for_complete(forced)
        await wait_periodic_ticks(pilot, app, 2)
        assert app.source.paused and app.snapshot.paused
        assert "PAUSED" in str(app.query_one("#status").render())
        built = app.snapshots_built
        await wait_periodic_ticks(pilot, app, 2)
        assert app.snapshots_built == built  # paused: the picture holds still over whole ticks
        await pilot.press("p")
        await wait_snapshots(pilot, app, built + 1)
        assert not app.snapshot.paused

        app.query_one(RequestsPanel).focus()
        await pilot.press("down")
        selected = app.query_one(RequestsPanel).selected()
        assert selected.request_id == app.snapshot.requests.rows[1].request_id
        await pilot.press("enter")
        assert isinstance(app.screen, TextScreen)
        detail = str(app.screen.query_one("#text").render())
        assert selected.request_id in detail and "block ids" in detail
        await pilot.press("escape")
        assert not isinstance(app.screen, TextScreen)

        await pilot.press("question_mark")
        assert isinstance(app.screen, TextScreen) and "quit" in str(app.screen.query_one("#text").render())
        await pilot.press("escape")
        await pilot.press("q")
    assert app.return_code == 0


async def test_seek_moves_replay_forward(logs):
    app = make_app(logs["full"], seconds=10)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_snapshots(pilot, app)
        before = app.snapshot.now_ns
        await pilot.press("f")
        for _ in range(100):
            if app.snapshot.now_ns > before:
                break
            await pilot.pause(0.02)
        assert app.snapshot.now_ns - before == 10_000_000_000


async def test_locality_metric_key_and_alerts(logs):
    app = make_app(logs["full"])
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_snapshots(pilot, app)
        loc = app.query_one(LocalityPanel)
        loc.focus()
        await pilot.press("m")
        assert loc.metric == "sink" and "sink" in loc.border_title
        alerts = panel_text(app, AlertsPanel)
        # the rules without data are folded into one line; the others show their titles
        folded = [f.rule for f in app.snapshot.alerts if f.status == "n/a" and not f.rule.startswith("collector.")]
        shown = [f for f in app.snapshot.alerts if f.rule not in folded]
        assert shown and shown[0].title[:25] in alerts
        assert folded  # the full log leaves some checks without data: the folded line shows
        assert f"{len(folded)} checks without data: {folded[0]}"[:30] in alerts


async def test_screenshot_and_recording(logs, tmp_path):
    app = make_app(logs["full"], seconds=5, tmp_path=tmp_path)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_snapshots(pilot, app)
        await pilot.press("s")
        await pilot.press("s")  # same second (the test's clock is frozen): a second file, not an overwrite
        svgs = list(tmp_path.glob("*.svg"))
        assert len(svgs) == 2 and all("<svg" in p.read_text()[:500] for p in svgs)
        original = list(iter_events(logs["full"]))
        t0 = original[0].ts_ns

        def emitted_by(seconds):  # how many events a replay at this position has yielded
            pos = t0 + int(seconds * 1e9)
            return next((i for i, e in enumerate(original) if e.ts_ns > pos), len(original))

        assert app.snapshot.events == emitted_by(5)
        await pilot.press("r")
        assert app.recorder is not None
        await pilot.press("f")  # the seek makes the source yield 10 s of events into the recording
        for _ in range(200):  # bounded wait for the forced tick to fold them in
            if app.snapshot.events == emitted_by(15):
                break
            await pilot.pause(0.05)
        assert app.snapshot.events == emitted_by(15)
        await pilot.press("r")
        assert app.recorder is None
    recorded = list(iter_events(app.record_path))
    assert 0 < emitted_by(15) - emitted_by(5) < len(original)  # a real window, not all or nothing
    assert recorded == original[emitted_by(5):emitted_by(15)]  # exactly the log between 5 s and 15 s
    assert read_log(app.record_path).header.engine == read_log(logs["full"]).header.engine


async def test_compact_layout_at_80x24(logs):
    app = make_app(logs["bare"])
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_snapshots(pilot, app)
        assert app.screen.has_class("compact")
        for panel in app.query(Panel):
            assert panel.region.width >= 30 and panel.region.height >= 4, panel.id
        assert "--shadow" in panel_text(app, "#compressionpanel")


def _ready(app):
    async def run_before(pilot):
        await wait_snapshots(pilot, app)
    return run_before


@pytest.mark.parametrize("size", [(120, 36), (80, 24)])
@pytest.mark.parametrize("kind", ["full", "bare"])
def test_main_screen_snapshot(snap_compare, logs, kind, size):
    """Main screen: `full` has GPU and shadow data; `bare` has no GPU and no shadow data."""
    app = make_app(logs[kind])
    assert snap_compare(app, terminal_size=size, run_before=_ready(app))


async def test_end_key_jumps_to_the_end_of_the_log(logs):
    app = make_app(logs["full"], seconds=0)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_snapshots(pilot, app)
        await pilot.press("end")
        for _ in range(200):
            if app.snapshot.finished_source:
                break
            await pilot.pause(0.05)
        assert app.snapshot.finished_source
        assert app.snapshot.events == len(read_log(logs["full"]))
        assert "END OF LOG" in str(app.status_line.render())
