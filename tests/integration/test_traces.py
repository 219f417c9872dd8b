"""Trace loaders, checked on inputs derived from the public Mooncake trace, and chunk hashing."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from kvdiag.simulation.sharing import simulate
from kvdiag.traces.detect import detect_format
from kvdiag.traces.lines import TraceFormatError
from kvdiag.traces.loaders import load_trace
from kvdiag.pool.hashing import ALGORITHMS, chunk_hashes

MOONCAKE = Path(__file__).parent.parent / "data" / "mooncake" / "synthetic_trace.jsonl"
N_REQUESTS = 120


def _mooncake_requests(n=N_REQUESTS):
    with open(MOONCAKE) as f:
        return [json.loads(next(f)) for _ in range(n)]


def _tokens_of(req):
    """Token ids that realise a Mooncake request: block j's 512 tokens all equal its hash id
    (chained ids, so equal token prefixes <=> equal id prefixes), the last block partial."""
    n = req["input_length"]
    return [h for j, h in enumerate(req["hash_ids"]) for _ in range(min(512, n - 512 * j))]


@pytest.fixture(scope="module")
def token_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "trace.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for req in _mooncake_requests():
            f.write(json.dumps({"timestamp": req["timestamp"] / 1000,
                                "token_ids": _tokens_of(req)}) + "\n")
    return path


def _prefix_keys(tokens, block):
    """sha256 of each full-block prefix, by an incremental hasher (independent of kvdiag)."""
    h = hashlib.sha256()
    keys = []
    for j in range(len(tokens) // block):
        h.update(repr(tokens[j * block:(j + 1) * block]).encode())
        keys.append(h.copy().digest())
    return keys


def _full_block_replay(requests, block, capacity):
    """OrderedDict LRU over token prefixes (tuples) of full blocks: hit tokens, prompt tokens."""
    cache: OrderedDict = OrderedDict()
    hit = total = 0
    for req in requests:
        toks = _tokens_of(req)
        keys = _prefix_keys(toks, block)
        h = 0
        while h < len(keys) and keys[h] in cache:
            h += 1
        hit += h * block
        total += len(toks)
        for k in keys:
            if k in cache:
                cache.move_to_end(k)
            else:
                while capacity is not None and len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[k] = True
    return hit, total


@pytest.mark.parametrize("block,capacity", [(512, None), (512, 300), (128, 1200)])
def test_token_trace_rechunked_equals_prefix_replay(token_trace, block, capacity):
    assert detect_format(token_trace) == "tokens"
    trace = load_trace(token_trace, block_size_tokens=block)
    hit, total = _full_block_replay(_mooncake_requests(), block, capacity)
    res = simulate(trace, "lru", capacity)
    assert (res.hit_tokens, res.prompt_tokens) == (hit, total)


def test_vllm_kv_events_reconstruct_prompts(tmp_path):
    """KV events as vLLM publishes them (stores of missing full blocks, parent = last cached
    block) of the Mooncake-derived prompts: the loader rebuilds each storing request's
    full-block prompt."""
    block = 256
    stored: dict[tuple, int] = {}
    lines, expected = [], []
    for i, req in enumerate(_mooncake_requests(40)):
        toks = _tokens_of(req)
        n_full = len(toks) // block
        keys = _prefix_keys(toks, block)
        h = 0
        while h < n_full and keys[h] in stored:
            h += 1
        if h == n_full:
            continue
        new = list(range(len(stored), len(stored) + n_full - h))
        for k, bh in zip(keys[h:], new):
            stored[k] = bh
        parent = stored[keys[h - 1]] if h else None
        ev = ["BlockStored", new, parent, toks[h * block: n_full * block], block, None, "GPU"]
        lines.append(json.dumps([1000.0 + i, [ev]]))
        expected.append(toks[: n_full * block])
    path = tmp_path / "kv_events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert detect_format(path) == "vllm"
    trace = load_trace(path)
    assert trace.block_size_tokens == block
    assert trace.prompt_tokens.tolist() == [len(t) for t in expected]
    want = load_trace_from_lists(expected, block)
    assert np.array_equal(trace.block_ids, want.block_ids)


def load_trace_from_lists(prompts, block):
    from kvdiag.traces.trace import trace_from_tokens

    return trace_from_tokens(prompts, block)


@pytest.mark.parametrize("content,where,expected", [
    ('{"hash_ids": [1, 2], "input_length": 600, "timestamp": 0}\n{"hash_ids": [1], '
     '"input_length": 600, "timestamp": 1}\n', 2, "hash_ids: expected ceil(input_length/512)"),
    ('{"hash_ids": [1], "input_length": 10, "timestamp": 0}\n{oops\n', 2, "expected one JSON"),
    ('{"token_ids": [1, 2, "x"]}\n', 1, "token_ids[2]: expected int, got str"),
    ('{"hello": 1}\n', 1, "expected a kvdiag log header"),
    ('["BlockStored", 1]\n', 1, "expected a kvdiag log header"),
    ('[1.0, [["BlockStored", [1], null, [1, 2, 3], 2, null, "GPU"]]]\n', 1,
     "BlockStored.token_ids: expected len(token_ids) = block_size x len(block_hashes)"),
])
def test_bad_input_names_file_and_line(tmp_path, content, where, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert str(err.value).startswith(f"{path}:{where}: ")
    assert expected in str(err.value)  # file:line: [field: ]expected ...


# ---------------------------------------------------------------- hashing


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_chained_keys_equal_iff_prefixes_equal(algorithm):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 49152, size=400)
    for cut in (0, 37, 64, 200, 399):
        other = base.copy()
        other[cut] += 1
        a = chunk_hashes(base, 32, algorithm=algorithm)
        b = chunk_hashes(other, 32, algorithm=algorithm)
        assert len(a) == 400 // 32  # only full chunks
        # equal exactly for the chunks that end before the changed token
        assert (a == b).tolist() == [(j + 1) * 32 <= cut for j in range(len(a))]
        assert (a >= 0).all()
    assert not np.intersect1d(chunk_hashes(base, 32, algorithm=algorithm),
                              chunk_hashes(base, 32, algorithm=algorithm, extra_keys=("lora-1",))).size
    # a parent key is part of every key of the chain
    p1 = chunk_hashes(base, 32, algorithm=algorithm, parent=12345)
    assert np.array_equal(p1, chunk_hashes(base, 32, algorithm=algorithm, parent=12345))
    assert not np.intersect1d(p1, chunk_hashes(base, 32, algorithm=algorithm, parent=54321)).size


def test_fast_hash_matches_its_sequential_definition():
    """The vectorised scan equals H_i = K*H_{i-1} + c_i evaluated one chunk at a time."""
    from kvdiag.pool import hashing as H

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 49152, size=16 * 9)
    with np.errstate(over="ignore"):
        mixed = H._splitmix64(tokens.astype(np.uint64)).reshape(9, 16)
        acc = 0
        want = []
        for row in mixed:
            c = 0
            for x in row:
                c = (c * int(H._TOKEN_BASE) + int(x)) & 0xFFFFFFFFFFFFFFFF
            c = int(H._splitmix64(np.array([c], dtype=np.uint64))[0])
            acc = (acc * H._CHAIN_BASE + c) & 0xFFFFFFFFFFFFFFFF
            want.append(int(H._splitmix64(np.array([acc], dtype=np.uint64))[0]) & H.MASK63)
    assert chunk_hashes(tokens, 16).tolist() == want


# ---------------------------------------------------------------- kvdiag event logs


def _write_log(path, requests, *, with_tokens, block_size):
    """A kvdiag log of Mooncake-derived requests, as an engine adapter records them: arrivals
    (with token ids or not), the engine's prefix hits and stored blocks, finishes."""
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.events.schema import BlockStored, PrefixHit, RequestArrived, RequestFinished

    seen = set()
    with LogWriter(path, make_header(engine="test", block_size_tokens=block_size,
                                     bytes_per_token=46080)) as w:
        for i, req in enumerate(requests):
            rid, t0 = str(i), 1_000_000 * req["timestamp"] + 2 * i  # unique, in trace order
            toks = _tokens_of(req)
            w.record(RequestArrived(ts_ns=t0, request_id=rid, prompt_tokens=len(toks),
                                    token_ids=toks if with_tokens else None))
            ids = req["hash_ids"]
            h = 0
            while h < len(ids) and ids[h] in seen:
                h += 1
            for j, b in enumerate(ids):
                n = min(512, len(toks) - 512 * j)
                if j < h:
                    w.record(PrefixHit(ts_ns=t0, request_id=rid, block_id=j, block_hash=b,
                                       num_tokens=n))
                else:
                    w.record(BlockStored(ts_ns=t0, block_id=j, block_hash=b, num_tokens=n,
                                         request_id=rid))
                    seen.add(b)
            # finishing at once: the finish row re-touches the prompt in the same order
            w.record(RequestFinished(ts_ns=t0 + 1, request_id=rid,
                                     prompt_tokens=len(toks), output_tokens=1,
                                     cached_prompt_tokens=512 * h))


def test_kvdiag_log_with_block_events_equals_mooncake(tmp_path):
    requests = _mooncake_requests()
    log = tmp_path / "blocks.kvlog.gz"
    _write_log(log, requests, with_tokens=False, block_size=512)
    assert detect_format(log) == "kvdiag"
    trace = load_trace(log)
    ref = load_trace(MOONCAKE)
    n = ref.offsets[len(requests)]
    prompts = trace.requests_only()
    assert np.array_equal(prompts.block_ids, ref.block_ids[:n])
    assert np.array_equal(prompts.block_tokens, ref.block_tokens[:n])
    for cap in (None, 300):
        got, want = simulate(trace, "lru", cap), simulate(ref, "lru", cap)
        assert got.hit_tokens == sum(want.request_hit_tokens[:len(requests)])
    assert trace.bytes_per_token == 46080
    assert prompts.engine_cached_tokens.tolist() == [
        512 * int(h) for h in simulate(trace, "lru", None).request_hit_blocks]
    with pytest.raises(TraceFormatError, match="expected --block-size 512"):
        load_trace(log, block_size_tokens=64)


def test_kvdiag_log_with_token_ids_rechunks(tmp_path):
    requests = _mooncake_requests(40)
    log = tmp_path / "tokens.kvlog"
    _write_log(log, requests, with_tokens=True, block_size=512)
    for block in (None, 128):
        trace = load_trace(log, block_size_tokens=block)
        hit, total = _full_block_replay(requests, block or 512, 100)
        res = simulate(trace, "lru", 100)
        assert (res.hit_tokens, res.prompt_tokens) == (hit, total)
    assert trace.rows == 80 and trace.requests == 40
    keep = trace.counted.astype(bool)
    assert (trace.finish_ns[keep] - trace.arrival_ns[keep]).tolist() == [1] * 40


ENGINE_LOG = Path(__file__).parent.parent / "data/sharing_engine/two_waves.kvlog"


def test_recorded_engine_log_token_and_block_paths_agree_with_engine(tmp_path):
    """On a log recorded from the real engine, re-chunking the prompts' token ids at the
    engine's page size and replaying the engine's own block events give the same hits, and
    both equal what the engine reported (its pool never filled: LRU unbounded applies)."""
    tokens = load_trace(ENGINE_LOG)
    stripped = tmp_path / "blocks.kvlog"
    with open(ENGINE_LOG) as f, open(stripped, "w") as g:
        for line in f:
            obj = json.loads(line)
            if obj.get("type") == "request_arrived":
                obj["token_ids"] = None
            g.write(json.dumps(obj) + "\n")
    blocks = load_trace(stripped)
    assert tokens.block_size_tokens == blocks.block_size_tokens == 32
    a, b = simulate(tokens, "lru", None), simulate(blocks, "lru", None)
    assert a.request_hit_tokens.tolist() == b.request_hit_tokens.tolist()
    assert a.hit_tokens > 0
    engine = tokens.requests_only().engine_cached_tokens
    assert (engine >= 0).all() and a.request_hit_tokens.tolist() == engine.tolist()


DEMO_LOG = Path(__file__).parent.parent / "data/demo_small/demo_24req_seed1.kvlog.gz"


def test_demo_log_shadow_at_engine_settings_explains_engine_hits():
    """On the recorded demo (pool never full, so LRU unbounded at page 32 is the engine's own
    setting): the content never promises less than the engine delivered, and wherever it
    promises more, an earlier request with the same leading block was still prefilling
    (no first token yet) when this one arrived: its blocks did not exist yet."""
    from kvdiag.events import eventlog
    from kvdiag.events.schema import RequestArrived, RequestFirstToken

    trace = load_trace(DEMO_LOG)
    assert trace.block_size_tokens == 32
    res = simulate(trace, "lru", None)
    reqs = trace.requests_only()
    engine = reqs.engine_cached_tokens
    assert (engine >= 0).all() and (res.request_hit_tokens >= engine).all()
    arrived = [e for e in eventlog.iter_events(DEMO_LOG) if isinstance(e, RequestArrived)]
    first = {e.request_id: e.ts_ns for e in eventlog.iter_events(DEMO_LOG)
             if isinstance(e, RequestFirstToken)}
    for i in np.nonzero(res.request_hit_tokens > engine)[0]:
        a = arrived[i]
        assert any(b.ts_ns < a.ts_ns and b.token_ids[:32] == a.token_ids[:32]
                   and first.get(b.request_id, a.ts_ns + 1) > a.ts_ns for b in arrived[:i])
    assert (engine > 0).sum() > 1  # the engine really shared blocks
