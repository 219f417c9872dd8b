"""Cost of the miss-cause fold (kvdiag.diagnosis.miss_causes) on the live path, events/s on one
core, on the vLLM-shaped stream of benchmarks/vllm_stream.py (CONSTRUCTED DATA):

- ``fold, stream as is``: ``MissCauseFold.feed`` over the stream (its arrivals carry no content:
  the fold reads arrivals, finishes and the pool and passes over block events);
- ``fold, with content``: the same stream whose arrivals carry chunk hashes (16-token chunks,
  60% of prompts continue a random earlier prompt's chain for a random length, the rest fresh):
  every finished request's missed tokens are attributed block by block against the shadow LRU
  at the pool's 20,000 blocks;
- ``LiveState.feed_all with / without the fold``: top's whole fold on the content stream, and
  the same with the miss-cause fold switched off: the share of top's fold it costs.

Rounds are interleaved; the best round of each is printed with ``/proc/loadavg``.

Usage: python benchmarks/bench_miss_causes.py [--events 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import msgspec  # noqa: E402

from kvdiag.events import schema as s  # noqa: E402
from kvdiag.diagnosis.miss_causes import MissCauseFold  # noqa: E402
from kvdiag.live import state as live_state  # noqa: E402
from kvdiag.live.state import LiveState  # noqa: E402
from vllm_stream import BLOCK_TOKENS, events  # noqa: E402


def with_content(stream, seed: int = 1):
    """The stream with chunk hashes on every arrival (one 16-token chunk per block)."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    prompts: dict[str, int] = {}
    for ev in stream:
        if type(ev) is s.RequestFinished:  # the stream counts grown blocks as prompt: not here
            ev = msgspec.structs.replace(ev, prompt_tokens=prompts.pop(ev.request_id, ev.prompt_tokens))
        if type(ev) is s.RequestArrived:
            prompts[ev.request_id] = ev.prompt_tokens
            n = ev.prompt_tokens // BLOCK_TOKENS
            keys: list[int] = []
            if chains and rng.random() < 0.6:
                chain = chains[rng.randrange(len(chains))]
                keys = chain[:rng.randint(1, min(len(chain), n))]
            keys += [rng.getrandbits(63) for _ in range(n - len(keys))]
            if len(chains) < 256:
                chains.append(keys)
            else:
                chains[rng.randrange(256)] = keys
            ev = msgspec.structs.replace(ev, chunk_hashes=keys, partial_tokens=0)
        yield ev


def rate(fn, evs) -> float:
    t = time.perf_counter()
    fn(evs)
    return len(evs) / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    plain = list(events(args.events))
    content = list(with_content(iter(plain)))
    best: dict[str, float] = {}

    def fold_all(evs):
        f = MissCauseFold(engine="vllm")
        f.feed_all(evs)
        return f

    def state_all(evs, off=False):
        saved = live_state.MISS_FOLD_EVENTS
        if off:  # LiveState wires the fold into its handlers for these types only
            live_state.MISS_FOLD_EVENTS = ()
        try:
            st = LiveState()
        finally:
            live_state.MISS_FOLD_EVENTS = saved
        st.feed_all(evs)

    for _ in range(args.rounds):
        for name, fn, evs in (("fold, stream as is", fold_all, plain),
                              ("fold, with content", fold_all, content),
                              ("LiveState.feed_all with the fold", state_all, content),
                              ("LiveState.feed_all without the fold", lambda e: state_all(e, True), content)):
            best[name] = max(best.get(name, 0.0), rate(fn, evs))
    f = fold_all(content)
    t = f.tally
    print(f"{len(plain):,} events, {t.requests:,} finished requests, {t.missed_tokens:,} missed tokens: "
          + ", ".join(f"{c} {n:,}" for c, n in t.by_cause().items()))
    for name, r in best.items():
        print(f"{name:<40} {r / 1e6:6.2f} M events/s")
    with open("/proc/loadavg") as fh:
        print("loadavg:", fh.read().strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
