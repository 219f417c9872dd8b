"""The recorded demo log in tests/data/demo_small satisfies the demo's invariants (offline)."""

from __future__ import annotations

from pathlib import Path

from demo_invariants import expected_blocks, replay, timestamps_problems
from kvdiag.events.eventlog import read_log

RECORDED = Path(__file__).parent.parent / "data" / "demo_small" / "demo_24req_seed1.kvlog.gz"


def test_recorded_demo_log_replays_consistently():
    log = read_log(RECORDED, strict=True)
    assert not log.problems
    r = replay(RECORDED)
    assert not r.problems, r.problems[:5]
    assert len(r.finished) == 25
    for rid, fin in r.finished.items():
        assert r.held_at_finish[rid] == []
        assert r.blocks_at_finish[rid] == expected_blocks(fin.prompt_tokens, fin.output_tokens, r.page_size)
        assert fin.cached_prompt_tokens == r.prefix_hit_tokens.get(rid, 0) == r.expected_cached_tokens[rid]
    assert r.last_sample.blocks_cached == len(r.cached_blocks_at_end)
    assert timestamps_problems(RECORDED) == []
