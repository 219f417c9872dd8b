"""Sample a target's Python stacks with py-spy and attribute them to serving phases.

``py-spy record --nonblocking`` writes collapsed stacks over a window; every py-spy run here is
``--nonblocking``: py-spy reads the target's memory without ptrace-attaching it, so the target
is never paused, traced or written to (a read may catch it mid-update: a failed sample). Each
sample is classified by its frames, innermost first, into one of :data:`PHASES`. ``idle``
means the sampled thread was waiting (its innermost frame is a known wait: select/poll/sleep/
lock/queue get); py-spy is run with ``--idle`` so waiting threads are counted.
The share of a phase = its samples / all samples of the window (threads x ticks).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

from kvdiag.events.schema import CollectorStatus, PhaseProfile

NAME = "py-spy"
PHASES = ("attention", "kv_cache", "compression", "sampling", "scheduler", "http", "model", "idle", "other")
"""``kv_cache``: KV block allocation, release, prefix matching and eviction; ``model``: the
rest of the forward pass (MLPs, norms, embeddings)."""

# (phase, regex on "function (file:line)") tried innermost frame first; the first hit decides
_RULES: list[tuple[str, re.Pattern]] = [
    ("compression", re.compile(r"quant|compress|quanto|hqq|fp8|int4|int8", re.I)),
    ("kv_cache", re.compile(
        r"allocate_blocks|free_blocks|evict|acquire_prefix|search_prefix|mark_complete_blocks|"
        r"BlockLedger|CacheAllocator|block_manager|kv_cache_manager|block_pool|allocate_slots|"
        r"get_computed_blocks|cache_blocks|PagedAttentionCache\.(allocate|free|update|extend)|"
        r"cache_manager|DynamicCache|Cache\.update|update \(.*cache_utils", re.I)),
    ("attention", re.compile(r"attention|attn|sdpa|scaled_dot_product|flash|paged_attention|rotary|rope", re.I)),
    ("sampling", re.compile(r"sampl|logits_process|logitsprocessor|top_k|top_p|multinomial|argmax|"
                            r"temperature|repetition_penalty", re.I)),
    ("model", re.compile(r"forward|modeling_|/nn/modules/|\(linear\.py|\(activation|mlp|norm", re.I)),
    ("scheduler", re.compile(r"schedul|continuous_batching|batch_processor|engine_core|step \(|"
                             r"_generation_step|prepare_next_batch|add_request", re.I)),
    ("http", re.compile(r"uvicorn|starlette|fastapi|h11|httptools|aiohttp|http|serve|openai|"
                        r"asyncio|anyio|StreamingResponse", re.I)),
]
_IDLE_LEAF = re.compile(
    r"^(?:[\w<>]+\.)*(wait|wait_for|select|poll|epoll|kqueue|sleep|_sleep|_wait_for_tstate_lock|"
    r"acquire|get|accept|recv|recv_into|readinto|join) \(")


class PySpyError(RuntimeError):
    """py-spy cannot sample the target; the message says what to do."""


@dataclass(slots=True)
class RawProfile:
    """Collapsed stacks (outermost frame first) with their sample counts, per window."""

    pid: int
    window_ns: int
    stacks: Counter = field(default_factory=Counter)
    errors: int = 0


NOT_FOUND = "py-spy not found beside this Python or on PATH: pip install py-spy (phases are N/A)"


def pyspy_binary() -> Optional[str]:
    """The py-spy installed with this kvdiag (the running interpreter's scripts folder, where
    pip puts it even when the environment is not activated), else the one on PATH."""
    for folder in dict.fromkeys((os.path.dirname(sys.executable), sysconfig.get_path("scripts"))):
        candidate = os.path.join(folder, "py-spy")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("py-spy")


def status() -> CollectorStatus:
    """Whether py-spy is installed (reported once)."""
    path = pyspy_binary()
    return CollectorStatus(ts_ns=time.time_ns(), collector=NAME, available=path is not None,
                           hint=path or NOT_FOUND)


def explain_failure(pid: int, stderr: str) -> str:
    """Turn py-spy's error output into one actionable sentence."""
    text = stderr.lower()
    if "permission denied" in text or "operation not permitted" in text or "eperm" in text:
        return (f"py-spy may not read process {pid}: run kvdiag as root (or as the target's user), "
                "grant CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE), or allow ptrace with "
                "'echo 0 > /proc/sys/kernel/yama/ptrace_scope'")
    if "failed to find python version" in text or "failed to find a python interpreter" in text:
        return f"process {pid} is not a Python process (py-spy found no interpreter): phases are N/A"
    if "check that the process is running" in text or "no such process" in text:
        return f"process {pid} has exited"
    first = next((l.strip() for l in stderr.splitlines() if l.strip().startswith("Error")), stderr.strip()[:200])
    return f"py-spy failed on process {pid}: {first}"


_PROCESS = re.compile(r'process (\d+):".*?";', re.S)
_THREAD = re.compile(r"^thread \(\d+\)")
_PROCESS_MARK = re.compile(r"^process (\d+)$")


def parse_raw(text: str, exclude_pids: Iterable[int] = ()) -> Counter:
    """Collapsed stacks from ``py-spy record --format raw`` (``frame;frame;... count`` per
    line, outermost first). With ``--subprocesses`` each stack starts with
    ``process N:"command line"`` elements (the sampled process last) whose command may span
    lines; they are dropped, and so are the stacks sampled in a process of ``exclude_pids``."""
    exclude = set(exclude_pids)
    text = _PROCESS.sub(lambda m: f"process {m.group(1)};", text)
    out: Counter = Counter()
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit() or not stack:
            continue
        frames, pid = [], None
        for f in stack.split(";"):
            mark = _PROCESS_MARK.match(f)
            if mark:
                pid = int(mark.group(1))
            elif f and not _THREAD.match(f):
                frames.append(f)
        if pid not in exclude:
            out[tuple(frames)] += int(count)
    return out


def classify(frames: tuple[str, ...]) -> str:
    """The phase of one stack (outermost first): ``idle`` if its innermost frame waits, else
    the first rule matching a frame from the innermost outwards, else ``other``."""
    if not frames or _IDLE_LEAF.match(frames[-1]):
        return "idle"
    for frame in reversed(frames):
        for phase, rx in _RULES:
            if rx.search(frame):
                return phase
    return "other"


def phase_profile(raw: RawProfile, ts_ns: Optional[int] = None, top: int = 10) -> PhaseProfile:
    """Shares per phase (summing to 1 over all samples) and the ``top`` hottest functions by
    self share (innermost frame) among non-idle samples."""
    phases: Counter = Counter()
    hot: Counter = Counter()
    for frames, n in raw.stacks.items():
        phase = classify(frames)
        phases[phase] += n
        if phase != "idle" and frames:
            hot[frames[-1]] += n
    total = sum(phases.values())
    shares = {p: phases[p] / total for p in PHASES if phases[p]} if total else {}
    top_functions = [(f, n / total) for f, n in hot.most_common(top)] if total else []
    return PhaseProfile(ts_ns=ts_ns or time.time_ns(), pid=raw.pid, window_ns=raw.window_ns,
                        num_samples=total, shares=shares, top_functions=top_functions)


class PySpyRecorder:
    """One non-blocking ``py-spy record`` window running in the background."""

    def __init__(self, pid: int, duration_s: float, rate_hz: int = 50, subprocesses: bool = True,
                 exclude_pids: Iterable[int] = ()) -> None:
        """``exclude_pids``: processes of the tree whose stacks are dropped (kvdiag's own)."""
        exe = pyspy_binary()
        if exe is None:
            raise PySpyError(NOT_FOUND)
        self.pid = pid
        self.exclude_pids = frozenset(exclude_pids)
        fd, self.out_path = tempfile.mkstemp(prefix="kvdiag-pyspy-", suffix=".txt")
        os.close(fd)
        cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))),
               "--rate", str(rate_hz), "--format", "raw", "--idle", "--nonblocking", "-o", self.out_path]
        if subprocesses:
            cmd.append("--subprocesses")
        self.start_ns = time.time_ns()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def result(self, timeout_s: Optional[float] = None) -> RawProfile:
        """Wait for the window; raises :class:`PySpyError` with an actionable message."""
        try:
            _, err = self.proc.communicate(timeout=timeout_s)
            end = time.time_ns()
            with open(self.out_path) as f:
                text = f.read()
        finally:
            self._cleanup_file()
        stacks = parse_raw(text, self.exclude_pids)
        if self.proc.returncode != 0 and not stacks:
            raise PySpyError(explain_failure(self.pid, err or ""))
        m = re.search(r"Errors: (\d+)", err or "")
        return RawProfile(self.pid, end - self.start_ns, stacks, int(m.group(1)) if m else 0)

    def stop(self) -> RawProfile:
        """End the window early (py-spy writes what it has on SIGINT)."""
        if self.proc.poll() is None:
            self.proc.send_signal(2)
        try:
            return self.result(timeout_s=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._cleanup_file()
            raise PySpyError(f"py-spy did not stop on process {self.pid}") from None

    def _cleanup_file(self) -> None:
        try:
            os.unlink(self.out_path)
        except OSError:
            pass


def dump(pid: int, timeout_s: float = 10.0) -> list[dict]:
    """One ``py-spy dump --json --nonblocking``: threads with their frames; raises
    :class:`PySpyError` with an actionable message."""
    exe = pyspy_binary()
    if exe is None:
        raise PySpyError(NOT_FOUND)
    import json
    r = subprocess.run([exe, "dump", "--pid", str(pid), "--json", "--nonblocking"],
                       capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise PySpyError(explain_failure(pid, r.stderr))
    return json.loads(r.stdout)
