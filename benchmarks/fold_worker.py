"""One round of the live-fold timings, for ``bench_top.py --compare`` (run by it, not by hand).

Run with ``PYTHONPATH`` at the tree to time (this checkout or an older one extracted by
``git archive``): it reads the events of ``PLAIN`` and ``CONTENT`` (JSON lines, the vLLM-shaped
stream without and with hashes-mode content, written once by the parent) with that tree's
schema, times each fold once on one core (``time.process_time``) and prints one JSON object:
microseconds per event of each, and the file the ``kvdiag`` package came from.

``--marks``: call ``getppid()`` before each timing and after the last (and print the timings'
names in that order), for a run under ``valgrind --tool=callgrind --dump-before=getppid``
(``bench_top.py --compare REF --instructions``): each timing is then one part of the profile,
its instructions counted whatever the machine's load.

Usage: python benchmarks/fold_worker.py PLAIN CONTENT [--marks]
"""

from __future__ import annotations

import gc
import json
import os
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
    warm = LiveState()  # warm: the compiled kernels load once, before any timing
    warm.feed_all(content[:20_000])
    if hasattr(warm, "curves"):
        warm.curves.view()  # the curve's kernel (its first flush)
    try:
        from kvdiag.simulation import _misskernels
        if getattr(_misskernels, "_warm_thread", None) is not None:
            _misskernels._warm_thread.join()  # the miss fold's, loaded in a background thread
    except ImportError:  # a tree from before the miss causes
        pass

    mark = os.getppid if "--marks" in sys.argv[3:] else (lambda: None)

    def timed(name, fn, n):
        # what is alive now (the decoded input, the earlier timings' leftovers) is frozen out
        # of the collector: top's own input is one chunk, young; a full collection over a
        # million decoded events would be this benchmark's cost, not top's (and would move
        # each timing by when it happens to run)
        gc.collect()
        gc.freeze()
        mark()
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
    mark()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
