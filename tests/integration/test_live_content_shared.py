"""top's fold reads each arrival's content once (``Content.of_arrival``) and hashes it once per
block size (``Content.keys``), shared by the miss causes and the capacity curve: on random
streams (CONSTRUCTED DATA: token ids, or their hashes-mode form; shared prefixes, cache
domains, preemptions, engine-cached prefixes) the causes equal the brute force of
test_miss_causes (the shadow as a list of token prefixes), the evicted blocks' distances and
ages a brute force of the same shadow with its evicted-key history, and the curve equals a brute-force
LRU stack over the same prefixes, event by event as well as in one ``feed_all``."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.diagnosis.miss_tally import CAUSES
from kvdiag.events.schema import KVPoolInfo, RequestArrived, RequestFinished, RequestPreempted
from kvdiag.live.state import LiveState
from kvdiag.pool.hashing import Content, ContentHasher
from kvdiag.simulation.capacity_curve import POOL_MULTIPLES
from test_miss_causes import brute_force

BS = 16  # a block size a hashes-mode log (16-token chunks) can key


def _pool(blocks: int) -> KVPoolInfo:
    return KVPoolInfo(ts_ns=1, num_blocks=blocks, block_size_tokens=BS, block_bytes=64, num_layers=1,
                      num_kv_heads=1, head_dim=1, dtype="float32", prefix_sharing=True)


@st.composite
def streams(draw):
    """(events with token ids, pool blocks): arrivals of shared prefixes plus a random tail,
    finishes (some preempted first) with a block-multiple engine-cached prefix."""
    prefixes = draw(st.lists(st.lists(st.integers(0, 3), min_size=BS, max_size=4 * BS), min_size=1, max_size=4))
    pool = draw(st.integers(1, 12))
    events, live, t = [_pool(pool)], [], 10
    for i in range(draw(st.integers(1, 40))):
        t += draw(st.integers(0, 9)) * 1_000_000
        if live and draw(st.booleans()):
            rid, toks = live.pop(draw(st.integers(0, len(live) - 1)))
            if draw(st.integers(0, 4)) == 0:
                events.append(RequestPreempted(ts_ns=t, request_id=rid))
                t += 1
            cached = draw(st.integers(0, len(toks))) // BS * BS
            events.append(RequestFinished(ts_ns=t, request_id=rid, prompt_tokens=len(toks), output_tokens=1,
                                          cached_prompt_tokens=cached))
        else:
            toks = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 3), max_size=2 * BS))
            domain = draw(st.sampled_from((None, None, "tenant-1")))
            events.append(RequestArrived(ts_ns=t, request_id=f"r{i}", prompt_tokens=len(toks),
                                         token_ids=toks, cache_domain=domain))
            live.append((f"r{i}", toks))
    return events, pool


def evicted_brute_force(events, capacity: int, history: int) -> tuple[list[int], list[int], int]:
    """The tally's evicted tokens by log2 bin of reuse distance (block references) and of ms
    since last use, and those of unknown distance, the slow way: the shadow as a list of
    (domain, prefix) in LRU order, the evicted ones in a list of at most ``history`` (oldest
    dropped: distance unknown), a clock of block references; a block held after its prefix
    broke carries the first missed block's figures."""
    from kvdiag.diagnosis.miss_tally import REUSE_BINS
    lru, ghost, seen, last = [], [], set(), {}
    clock = unknown = 0
    reuse, age, live = [0] * REUSE_BINS, [0] * REUSE_BINS, {}

    def touch(k, now) -> None:
        nonlocal clock
        clock += 1
        if k in lru:
            lru.remove(k)
        else:  # room first (the history may let k go), then k leaves the history
            while len(lru) >= capacity:
                ghost.append(lru.pop(0))
                if len(ghost) > history:
                    ghost.pop(0)
            if k in ghost:
                ghost.remove(k)
        lru.append(k)
        seen.add(k)
        last[k] = (clock, now)

    for ev in events:
        if isinstance(ev, RequestArrived):
            keys = [(ev.cache_domain, tuple(ev.token_ids[:(j + 1) * BS])) for j in range(ev.prompt_tokens // BS)]
            h = 0
            while h < len(keys) and keys[h] in lru:
                h += 1
            evicted = {}  # block -> (distance, age in ns) or None: unknown
            brk = None
            for j in range(h, len(keys)):
                k = keys[j]
                fig = (clock - last[k][0], max(ev.ts_ns - last[k][1], 0)) if k in ghost else None
                if j == h:
                    brk = fig
                if k in seen:
                    evicted[j] = brk if k in lru else fig
            live[ev.request_id] = (keys, evicted)
            for k in keys:
                touch(k, ev.ts_ns)
        elif isinstance(ev, RequestFinished) and ev.request_id in live:
            keys, evicted = live.pop(ev.request_id)
            for t in range(ev.cached_prompt_tokens, ev.prompt_tokens):
                j = t // BS
                if j not in evicted:
                    continue
                if evicted[j] is None:
                    unknown += 1
                else:
                    d, a = evicted[j]
                    reuse[min(d.bit_length(), REUSE_BINS - 1)] += 1
                    age[min((a // 1_000_000).bit_length(), REUSE_BINS - 1)] += 1
            for k in keys:
                touch(k, ev.ts_ns)
    return reuse, age, unknown


def curve_brute_force(events, capacities: list[int]) -> list[float]:
    """Token hit rate of LRU at each capacity, the slow way: one recency list of token prefixes
    (no domain: the curve keys content alone); an arrival's leading blocks among the C most
    recent hit, then its blocks are used in order; a finish uses its prompt's blocks again."""
    recency: list = []  # most recent last
    hits, prompt_tokens, rows = Counter(), 0, {}
    for ev in events:
        if isinstance(ev, RequestArrived):
            toks = ev.token_ids
            keys = [tuple(toks[:(j + 1) * BS]) for j in range(len(toks) // BS)]
            prompt_tokens += ev.prompt_tokens
            rank = {k: len(recency) - i for i, k in enumerate(recency)}
            for c in capacities:
                h = 0
                while h < len(keys) and rank.get(keys[h], c + 1) <= c:
                    h += 1
                hits[c] += h * BS
            rows[ev.request_id] = keys
        elif isinstance(ev, RequestFinished) and ev.request_id in rows:
            keys = rows.pop(ev.request_id)
        else:
            continue
        for k in keys:
            if k in recency:
                recency.remove(k)
            recency.append(k)
    return [hits[c] / prompt_tokens if prompt_tokens else None for c in capacities]


def _folded(events, one_by_one: bool) -> LiveState:
    state = LiveState()
    if one_by_one:
        for ev in events:
            state.feed(ev)
    else:
        state.feed_all(events)
    return state


@settings(max_examples=150, deadline=None)
@given(streams(), st.booleans(), st.booleans())
def test_shared_content_gives_the_brute_force_causes_and_curve(stream, hashes_mode, one_by_one):
    events, pool = stream
    want_causes = Counter()
    for per_request in brute_force(events, BS, pool, first_admission=False).values():
        want_causes.update(per_request)
    want_evicted = evicted_brute_force(events, pool, 4 * pool)  # the fold's default ghost_factor
    caps = [round(m * pool) for m in POOL_MULTIPLES]
    want_curve = curve_brute_force(events, caps)
    if hashes_mode:  # the same stream as a hashes-mode log records it (16-token chunk keys)
        hasher = ContentHasher()
        events = [hasher(ev) for ev in events]
    state = _folded(events, one_by_one)
    assert {c: n for c, n in state.misses.tally.by_cause().items() if n} == +want_causes
    assert state.misses.tally.missed_tokens == sum(
        max(e.prompt_tokens - e.cached_prompt_tokens, 0) for e in events if isinstance(e, RequestFinished))
    tally = state.misses.tally
    assert (tally.reuse_hist, tally.age_ms_hist, tally.evicted_unknown_tokens) == want_evicted
    view = state.curves.view()
    got_curve = [p.token_hit_rate for p in view.rows[0].points] if view.rows else [None] * len(caps)
    assert [p.capacity_blocks for p in view.rows[0].points] == caps if view.rows else True
    assert got_curve == want_curve


def test_one_content_per_arrival_and_one_key_array_per_block_size():
    """The two folds of one arrival get the same Content, hence the same key arrays."""
    ev = RequestArrived(ts_ns=1, request_id="a", prompt_tokens=40, token_ids=list(range(40)))
    c = Content.of_arrival(ev)
    assert Content.of_arrival(ev) is c and c.keys(16) is c.keys(16)
    other = RequestArrived(ts_ns=2, request_id="b", prompt_tokens=40, token_ids=list(range(40)))
    fresh = Content.of_arrival(other)
    assert fresh is not c and fresh.keys(16).tolist() == c.keys(16).tolist()
    assert c.keys(8).tolist() == Content(40, token_ids=list(range(40))).keys(8).tolist()
    assert len(c.keys(8)) == 5 and len(c.keys(16)) == 2
    assert CAUSES  # the causes the fold names
