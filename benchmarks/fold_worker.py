"""One round of the live-fold timings, for ``bench_top.py --compare`` (run by it, not by hand).

Run with ``PYTHONPATH`` at the tree to time (this checkout or an older one extracted by
``git archive``): it reads the events of ``PLAIN`` and ``CONTENT`` (JSON lines, the vLLM-shaped
stream without and with hashes-mode content, written once by the parent) with that tree's
schema, times each fold once on one core (``time.process_time``) and prints one JSON object:
microseconds per event of each, and the file the ``kvdiag`` package came from.

Usage: python benchmarks/fold_worker.py PLAIN CONTENT
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    import msgspec

    import kvdiag
    from kvdiag.events.schema import AnyEvent
    from kvdiag.live.rules import LiveRules
    from kvdiag.live.state import LiveState
    from kvdiag.pool.blockledger import BlockLedger

    try:
        from kvdiag.tui.app import CHUNK_EVENTS as TICK_CHUNK
    except ImportError:  # a tree from before the constant
        TICK_CHUNK = 20_000
    decoder = msgspec.json.Decoder(AnyEvent)
    with open(sys.argv[1], "rb") as f:
        lines = f.read().splitlines()
    with open(sys.argv[2], "rb") as f:
        content = [decoder.decode(line) for line in f.read().splitlines()]
    out: dict = {"kvdiag": kvdiag.__file__}
    LiveState().feed_all(content[:20_000])  # warm: the miss fold's compiled kernels load once

    def timed(name, fn, n):
        t = time.process_time()
        fn()
        out[name] = (time.process_time() - t) / n * 1e6

    events: list = []
    timed("msgspec JSON decode (for scale)", lambda: events.extend(decoder.decode(x) for x in lines), len(lines))
    n = len(events)
    timed("BlockLedger.apply_all", lambda: BlockLedger().apply_all(events), n)
    timed("LiveState.feed_all (top's fold)", lambda: LiveState().feed_all(events), n)

    def feed(state, rules, chunk) -> None:
        """As this tree's top feeds its state and rules (``LiveRules.fold``; a tree from before
        it fed both every event)."""
        if hasattr(rules, "fold"):
            rules.fold(state, chunk)
        else:
            state.feed_all(chunk)
            rules.record(chunk)

    def with_rules():
        state, rules = LiveState(), LiveRules()
        for i in range(0, n, 5_000):  # as top polls its source
            feed(state, rules, events[i:i + 5_000])
    timed("feed_all + LiveRules.record", with_rules, n)

    def with_curve():  # content: the miss-cause and capacity-curve folds work on every request
        state = LiveState()
        for i in range(0, len(content), 5_000):
            state.feed_all(content[i:i + 5_000])
            state.curves.view()
    timed("feed_all, content (miss causes + curve)", with_curve, len(content))

    def whole():  # top's whole live path on the content stream
        state, rules = LiveState(), LiveRules()
        for i in range(0, len(content), 5_000):
            feed(state, rules, content[i:i + 5_000])
            state.curves.view()
    timed("feed_all + rules + curve, content", whole, len(content))

    def tick():
        """top's tick at full speed (kvdiag/tui/app.py): every waiting event folded in chunks
        of its CHUNK_EVENTS, each with the rules' record, and one snapshot (the curve's view in
        it) per refresh interval, here a second of this process's CPU time, and at the end.
        The rules' runs are not in it: LiveRules spaces them to stay under its max_share
        (5%) of one core."""
        state, rules = LiveState(), LiveRules()
        last = time.process_time()
        for i in range(0, len(content), TICK_CHUNK):
            chunk = content[i:i + TICK_CHUNK]
            feed(state, rules, chunk)
            if time.process_time() - last >= 1.0:
                state.snapshot(chunk[-1].ts_ns)
                last = time.process_time()
        state.snapshot(content[-1].ts_ns)
    timed("top's tick, content (1 snapshot/s)", tick, len(content))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
