"""What kvdiag costs a real vLLM server: its plugin inside, and `kvdiag attach` outside.

    python benchmarks/bench_vllm_overhead.py [--rounds 6] [--requests 6]

Two vLLM servers from vLLM's environment (``kvdiag fetch-engine vllm``), the same model and
settings, up at the same time: one with kvdiag's plugin (``KVDIAG_AGENT=1``), one without. The
same seeded rounds of chats go to them in turn, interleaved round by round so that machine noise
falls on both alike: plugin, plain, plain with ``kvdiag attach`` running, again and again. Per
round, each request's answer is streamed, one at a time:

- **tokens per CPU-second**: completion tokens / CPU time (user + system) that the server's
  whole process tree (API server, engine core, worker) spent during the round, read from
  /proc. kvdiag's attach runs in its own process and is not counted: the question is what the
  target pays.
- **inter-token latency**: gaps between streamed chunks as the client receives them; P99 over
  all rounds of a condition.

Prints each condition against plain with the ratio, a 95% bootstrap interval over rounds
(paired by round), and the machine's load average before and after. Goals (issue 13): plugin
cost <= 2% (tokens per CPU-second >= 0.98 of plain, P99 inter-token <= 1.02x), attach within 1%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants, now."""
    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def stream_chat(base_url: str, model: str, system: str, question: str, max_tokens: int) -> tuple[int, list[float]]:
    """One streamed greedy chat: (completion tokens, inter-chunk gaps in seconds)."""
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    gaps, last, tokens = [], None, 0
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return tokens, gaps


def round_prompts(seed: int, requests: int) -> list[tuple[str, str]]:
    """A round's chats: a shared system prompt (prefix caching at work) and varied questions."""
    from kvdiag.traffic import load_corpus

    corpus = load_corpus()
    rng = random.Random(seed)
    system = f"[round {seed}] " + rng.choice(corpus["system_prompts"])["text"]
    fill = {"order": "NW1001", "days": "5", "item": "tent"}
    return [(system, rng.choice(corpus["questions"]).format_map(_Defaults(fill))) for _ in range(requests)]


class _Defaults(dict):
    """Template fields the corpus uses that ``round_prompts`` does not fill stay as they are."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def bootstrap_ratio(a: np.ndarray, b: np.ndarray, n: int = 5000, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of means a/b and its 95% interval, resampling rounds (paired)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(n, len(a)))
    ratios = a[idx].mean(axis=1) / b[idx].mean(axis=1)
    return float(a.mean() / b.mean()), float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=6, help="chats per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from kvdiag.child import reset_interrupt_signal
    from kvdiag.commands._demo_vllm import VllmServer
    from kvdiag.engines import SETUP_HINT, vllm_python
    from kvdiag.model import resolve_model

    python = vllm_python()
    if python is None:
        print(SETUP_HINT, file=sys.stderr)
        return 1
    model = resolve_model(None)
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-vllm-"))
    servers = {"plugin": VllmServer(python, model, tmp / "plugin.kvlog", plugin=True),
               "plain": VllmServer(python, model, tmp / "plain.kvlog", plugin=False)}
    load_before = os.getloadavg()
    try:
        for s in servers.values():  # one at a time: two compiling at once double the wait
            s.start()
            s.wait_ready()
        conditions = ("plugin", "plain", "plain+attach")
        cpu_per_token: dict[str, list[float]] = {c: [] for c in conditions}
        gaps: dict[str, list[float]] = {c: [] for c in conditions}
        for r in range(args.rounds):
            prompts = round_prompts(r, args.requests)
            order = conditions if r % 2 == 0 else tuple(reversed(conditions))
            for cond in order:
                server = servers["plugin" if cond == "plugin" else "plain"]
                attach = None
                if cond == "plain+attach":
                    attach = subprocess.Popen([sys.executable, "-m", "kvdiag", "attach", str(server.proc.pid),
                                               "--duration", "600", "--out", str(tmp / f"attach-{r}.kvlog")],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              # started from a background shell, SIGINT would be
                                              # ignored here and inherited: attach would not stop
                                              preexec_fn=reset_interrupt_signal)
                    time.sleep(3.0)  # attach up: probes done, py-spy sampling
                cpu0 = tree_cpu_s(server.proc.pid)
                tokens = 0
                for system, question in prompts:
                    # a distinct round prefix per condition so each server starts the round cold
                    n, g = stream_chat(server.base_url, str(model), f"[{cond}] {system}", question, args.max_tokens)
                    tokens += n
                    gaps[cond].extend(g)
                cpu = tree_cpu_s(server.proc.pid) - cpu0
                cpu_per_token[cond].append(tokens / cpu)
                if attach is not None:
                    attach.send_signal(2)
                    attach.wait(timeout=60)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{c} {cpu_per_token[c][-1]:.1f} tok/CPU-s" for c in conditions), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    load_after = os.getloadavg()
    plain = np.array(cpu_per_token["plain"])
    print(f"\nmachine: {os.cpu_count()} CPUs, load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(f"{'condition':<14} {'tokens/CPU-s':>13} {'ratio to plain':>15} {'95% interval':>17} {'P99 ITL ms':>11} {'ratio':>6}")
    p99_plain = float(np.percentile(gaps["plain"], 99))
    for cond in conditions:
        vals = np.array(cpu_per_token[cond])
        ratio, lo, hi = bootstrap_ratio(vals, plain)
        p99 = float(np.percentile(gaps[cond], 99))
        print(f"{cond:<14} {vals.mean():13.2f} {ratio:15.3f} {f'{lo:.3f}..{hi:.3f}':>17} {p99 * 1e3:11.1f} "
              f"{p99 / p99_plain:6.3f}")
    for cond, goal in (("plugin", 0.98), ("plain+attach", 0.99)):
        ratio, lo, hi = bootstrap_ratio(np.array(cpu_per_token[cond]), plain)
        verdict = "met" if lo >= goal else ("missed" if hi < goal else "undecided")
        print(f"goal {cond}: tokens/CPU-s >= {goal} of plain: {verdict} ({ratio:.3f}, {lo:.3f}..{hi:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
