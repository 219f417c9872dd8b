"""The real logs the report and doctor tests run on.

- ``clean_log()``: the recorded `kvdiag demo` log in tests/data/demo_small/ (no fault).
- ``leak_log()``: recorded here, once per session, from the real model on transformers'
  continuous-batching engine with the kvdiag adapter injecting a leak (every 2nd finished
  request keeps its blocks in the engine); ``leaked_request_ids()`` is the adapter's own
  list of the requests it leaked, the oracle the doctor's answer is checked against.
- ``second_log(tmp)``: the demo log relabelled as node "node-b" (a second node).
"""

from __future__ import annotations

import atexit
import functools
import gzip
import shutil
import tempfile
import time
from pathlib import Path

import msgspec

DATA = Path(__file__).parent / "data" / "demo_small"
CLEAN = DATA / "demo_24req_seed1.kvlog.gz"


def read_bytes(path: str | Path) -> bytes:
    """A log's text, gzip or not."""
    data = Path(path).read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


@functools.lru_cache(maxsize=None)
def _dir() -> Path:
    """The session's folder for the logs recorded here, removed when the test process ends."""
    folder = tempfile.mkdtemp(prefix="kvdiag-test-logs-")
    atexit.register(shutil.rmtree, folder, True)
    return Path(folder)


def clean_log() -> str:
    return str(CLEAN)


@functools.lru_cache(maxsize=None)
def _leak_run() -> tuple[str, tuple[str, ...]]:
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from kvdiag.diagnosis.rules import RELEASE_GRACE_NS
    from kvdiag.collectors import transformers_cb as tcb
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.demo.smollm import ensure_model

    model_dir = ensure_model()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    page = 16
    path = _dir() / "leak.jsonl"
    header = make_header(engine="transformers-cb", model=str(model_dir), block_size_tokens=page,
                         bytes_per_token=46080, node="leak-run")
    skew_ns = [0]  # the events' clock runs this far ahead of the wall clock

    def clock_ns() -> int:
        return time.time_ns() + skew_ns[0]

    with LogWriter(path, header) as sink:
        adapter = tcb.install(sink, sample_interval_s=0.05, inject_leak_every=2, clock_ns=clock_ns)
        try:
            manager = model.init_continuous_batching(
                generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1),
                continuous_batching_config=ContinuousBatchingConfig(page_size=page, num_blocks=48,
                                                                    max_batch_tokens=64,
                                                                    allow_block_sharing=False))
            manager.start()
            for i in range(6):  # one at a time: every 2nd finished request leaks
                manager.add_request(list(range(100 + i, 150 + i)), request_id=f"q{i}")
                assert manager.get_result(f"q{i}", timeout=300) is not None
            # the doctor judges requests finished more than its grace period before the end:
            # the last sample is stamped a second past it, as if the engine had idled that long
            skew_ns[0] = RELEASE_GRACE_NS + 1_000_000_000
            adapter.sample_now()
            manager.stop(block=True)
        finally:
            adapter.uninstall()
    return str(path), tuple(adapter.leaked_requests)


def leak_log() -> str:
    return _leak_run()[0]


def leaked_request_ids() -> list[str]:
    return list(_leak_run()[1])


def second_log(tmp: Path) -> str:
    """The demo log as seen from a second node: same events, header node "node-b"."""
    lines = read_bytes(CLEAN).split(b"\n", 1)
    header = msgspec.json.decode(lines[0])
    header["node"] = "node-b"
    out = tmp / "node-b.jsonl"
    out.write_bytes(msgspec.json.encode(header) + b"\n" + lines[1])
    return str(out)
