"""Content as salted chained chunk hashes (issue 28): keys at any multiple of the chunk size
equal the token ids' keys, replay of a stripped log gives the token-id log's numbers, the salt
is per log, token ids never reach a default log, and older logs still load and replay."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvdiag.cli import main
from kvdiag.events.eventlog import iter_events, read_header
from kvdiag.pool.hashing import (CONTENT_CHUNK_TOKENS, chunk_hashes, keys_from_chunks,
                                    salted_chunk_hashes)
from kvdiag.events.schema import RequestArrived

DATA = Path(__file__).parent.parent / "data"
TOKEN_LOGS = [DATA / "sharing_engine" / "two_waves.kvlog",
              DATA / "demo_small" / "demo_24req_seed1.kvlog.gz"]
BLOCK_SIZES = (16, 32, 64, 128)


def _prompts(seed: int = 0, n: int = 40) -> list[list[int]]:
    """Prompts sharing prefixes of random lengths (some on chunk borders, most not)."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 50_000, 300).tolist() for _ in range(4)]
    out = []
    for _ in range(n):
        stem = stems[int(rng.integers(0, len(stems)))]
        keep = int(rng.choice([0, 15, 16, 17, 31, 32, 64, 100, 128, 250, 300]))
        out.append(stem[:keep] + rng.integers(0, 50_000, int(rng.integers(0, 200))).tolist())
    return out


def test_keys_from_chunks_equal_iff_prefixes_equal():
    """Brute force over every pair of prompts and every block: keys taken from the salted
    16-token chunk hashes are equal exactly when the first (j+1)*B tokens are equal, and there
    are as many as the token ids give."""
    prompts = _prompts()
    for bs in BLOCK_SIZES + (48,):
        keys = [keys_from_chunks(salted_chunk_hashes(p, "s"), bs) for p in prompts]
        for p, k in zip(prompts, keys):
            assert len(k) == len(p) // bs == len(chunk_hashes(p, bs))
        for a in range(len(prompts)):
            for b in range(len(prompts)):
                for j in range(min(len(keys[a]), len(keys[b]))):
                    same = prompts[a][:(j + 1) * bs] == prompts[b][:(j + 1) * bs]
                    assert (keys[a][j] == keys[b][j]) == same


def test_block_sizes_off_the_chunk_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        keys_from_chunks(salted_chunk_hashes(list(range(100)), "s"), 24)


def _strip(src: Path, out: Path) -> None:
    assert main(["export", str(src), "--strip-tokens", "-o", str(out)]) == 0


def _replay(path: Path, bs: int, capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["replay", str(path), "--json", "--block-size", str(bs), "--policy", "lru",
                 "--policy", "fifo", "--capacity", "4", "--capacity", "32",
                 "--capacity", "unbounded"]) == 0
    out = json.loads(capsys.readouterr().out)
    out.pop("source")
    return out


def _scan_no_token_ids(path: Path) -> int:
    """Every event of every type: no token ids anywhere; returns the events scanned."""
    n = 0
    for ev in iter_events(path, strict=True):
        n += 1
        fields = msgspec.to_builtins(ev)
        assert not fields.get("token_ids"), fields
    return n


@pytest.mark.parametrize("log", TOKEN_LOGS, ids=lambda p: p.parent.name)
def test_stripped_log_replays_like_the_token_log(log, tmp_path, capsys):
    out = tmp_path / "stripped.kvlog"
    _strip(log, out)
    assert _scan_no_token_ids(out) == sum(1 for _ in iter_events(log, strict=True))
    header = read_header(out)
    assert header.content == "hashes" and len(header.content_salt) == 32
    assert header.content_chunk_tokens == CONTENT_CHUNK_TOKENS
    originals = [ev for ev in iter_events(log, strict=True) if isinstance(ev, RequestArrived)]
    hashed = [ev for ev in iter_events(out, strict=True) if isinstance(ev, RequestArrived)]
    for a, h in zip(originals, hashed, strict=True):
        assert h.chunk_hashes == salted_chunk_hashes(a.token_ids, header.content_salt).tolist()
        assert h.partial_tokens == len(a.token_ids) % 16 and h.prompt_tokens == a.prompt_tokens
    for bs in BLOCK_SIZES:
        assert _replay(out, bs, capsys) == _replay(log, bs, capsys)


def test_stripping_twice_gives_two_salts_and_no_shared_hash(tmp_path):
    log = TOKEN_LOGS[1]
    a, b = tmp_path / "a.kvlog", tmp_path / "b.kvlog"
    _strip(log, a)
    _strip(log, b)
    assert read_header(a).content_salt != read_header(b).content_salt

    def hashes(path):
        return [ev.chunk_hashes for ev in iter_events(path, strict=True)
                if isinstance(ev, RequestArrived)]

    ha, hb = hashes(a), hashes(b)
    assert not {h for r in ha for h in r} & {h for r in hb for h in r}
    # within one log, requests whose first 16*(i+1) tokens are equal share chunk hash i
    prompts = [ev.token_ids for ev in iter_events(log, strict=True) if isinstance(ev, RequestArrived)]
    shared = 0
    for x in range(len(prompts)):
        for y in range(x + 1, len(prompts)):
            for i in range(min(len(ha[x]), len(ha[y]))):
                same = prompts[x][:16 * (i + 1)] == prompts[y][:16 * (i + 1)]
                assert (ha[x][i] == ha[y][i]) == same
                shared += same
    assert shared > 0


def test_a_hashed_log_cannot_be_stripped_again(tmp_path, capsys):
    out = tmp_path / "s.kvlog"
    _strip(TOKEN_LOGS[0], out)
    assert main(["export", str(out), "--strip-tokens", "-o", str(tmp_path / "t.kvlog")]) == 2
    assert "holds hashes already" in capsys.readouterr().err
    assert main(["export", str(TOKEN_LOGS[0]), "--strip-tokens", "-o", str(out)]) == 2


def test_similarity_asks_for_a_token_log(tmp_path):
    from kvdiag.traces.lines import TraceFormatError
    from kvdiag.traces.loaders import prompt_token_ids

    out = tmp_path / "s.kvlog"
    _strip(TOKEN_LOGS[0], out)
    with pytest.raises(TraceFormatError, match="--record-tokens"):
        prompt_token_ids(out)


def test_hashed_log_refuses_a_block_size_off_the_chunk(tmp_path, capsys):
    out = tmp_path / "s.kvlog"
    _strip(TOKEN_LOGS[0], out)
    assert main(["replay", str(out), "--block-size", "24"]) == 2
    assert "multiple of 16" in capsys.readouterr().err


def test_old_logs_load_and_replay(capsys):
    header = read_header(DATA / "schema_v1_0" / "all_types_required_fields.kvlog")
    assert header.content is None and header.content_salt is None
    assert sum(1 for _ in iter_events(DATA / "schema_v1_0" / "all_types_required_fields.kvlog",
                                      strict=True)) > 0
    for log in TOKEN_LOGS:
        assert read_header(log).content is None
        assert _replay(log, 32, capsys)["requests"] > 0


def test_record_tokens_env(monkeypatch):
    from kvdiag.agent import record_tokens_from_env

    monkeypatch.delenv("KVDIAG_RECORD_TOKENS", raising=False)
    assert not record_tokens_from_env()
    monkeypatch.setenv("KVDIAG_RECORD_TOKENS", "1")
    assert record_tokens_from_env()


def test_plan_trace_from_hashes_equals_token_ids(tmp_path, capsys):
    log = TOKEN_LOGS[1]
    out = tmp_path / "s.kvlog"
    _strip(log, out)

    def plan(path):
        capsys.readouterr()
        assert main(["plan", "--model", "smollm2-135m", "--trace", str(path), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        return got["rows"], got["timeline"], got["pool"]

    rows, *rest = plan(out)
    assert any(r["variant"] == "prefix sharing" and "exact" in r["assumption"] for r in rows)
    assert (rows, *rest) == plan(log)


def test_attach_keeps_the_agents_salt_and_hashes_an_id_recording(capsys):
    """attach's log header: the agent's own hashes and salt; an agent that records ids has them
    hashed on the way into the log unless --record-tokens keeps them (with the warning)."""
    from kvdiag.commands.attach import _content_of
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.schema import PrefixCacheStored

    hashed = make_header(content="hashes", content_salt="ab" * 16, content_chunk_tokens=16)
    hasher, content = _content_of(hashed, record_tokens=False)
    assert content == dict(content="hashes", content_salt="ab" * 16, content_chunk_tokens=16)
    engine_ev = PrefixCacheStored(ts_ns=1, seq=0, block_hashes=[7], token_ids=[1, 2],
                                  block_size_tokens=2)
    assert hasher(engine_ev).token_ids == []  # an engine's own KV events lose their ids too

    ids = make_header(content="token_ids")
    hasher, content = _content_of(ids, record_tokens=False)
    assert content["content"] == "hashes" and content["content_salt"] == hasher.salt
    arrived = RequestArrived(ts_ns=1, request_id="r", prompt_tokens=40, token_ids=list(range(40)))
    out = hasher(arrived)
    assert out.token_ids is None and out.partial_tokens == 8
    assert out.chunk_hashes == salted_chunk_hashes(list(range(40)), hasher.salt).tolist()
    capsys.readouterr()
    hasher, content = _content_of(ids, record_tokens=True)
    assert hasher is None and content == dict(content="token_ids")
    assert capsys.readouterr().err.count("recording prompts' token ids") == 1
