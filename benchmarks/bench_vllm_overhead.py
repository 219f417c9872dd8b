"""What kvdiag costs a real vLLM server: its plugin inside, and `kvdiag attach` outside.

    python benchmarks/bench_vllm_overhead.py [--rounds 6] [--requests 6]
    python benchmarks/bench_vllm_overhead.py --compare shadow [--shadow-env VAR=VALUE ...]

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

Rounds are interleaved and reported by the harness (benchmarks/overhead.py): each condition
against plain with the ratio, a 95% bootstrap interval over rounds (paired by round), the
verdict on its goal, and the machine's load average before, during and after. Goals (issue 13): plugin
cost <= 2% (tokens per CPU-second >= 0.98 of plain, P99 inter-token <= 1.02x), attach within 1%.

``--compare shadow`` measures the worker's shadow alone (issue 31): two servers, both with the
plugin, one with the worker's shadow on (``KVDIAG_SHADOW=1``, plus any ``--shadow-env``
settings, e.g. ``KVDIAG_SHADOW_RATE=0`` to keep the hooks and drop the runs), one with it off
(``KVDIAG_SHADOW=0``); goal: tokens per CPU-second >= 0.98 of the one without.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from contextlib import nullcontext
from pathlib import Path

import numpy as np
from overhead import Attached, Goal, InstructionCounter, RoundCost, perf_instructions_available, report, \
    round_prompts, run_interleaved, tree_cpu_s, tree_pids

from kvdiag.demo.traffic import CHAT_ROUTE


def stream_chat(base_url: str, model: str, system: str, question: str, max_tokens: int) -> tuple[int, list[float]]:
    """One streamed greedy chat: (completion tokens, inter-chunk gaps in seconds)."""
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    req = urllib.request.Request(f"{base_url}/{CHAT_ROUTE}", data=json.dumps(body).encode(),
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--requests", type=int, default=6, help="chats per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--compare", choices=("plugin", "shadow"), default="plugin",
                        help="plugin: plugin, plain and plain+attach (default); shadow: the plugin with "
                             "the worker's shadow against the plugin without it")
    parser.add_argument("--shadow-env", action="append", default=[], metavar="VAR=VALUE",
                        help="with --compare shadow: more environment for the shadowed server")
    args = parser.parse_args()
    shadow_env = dict(kv.split("=", 1) for kv in args.shadow_env)

    from kvdiag.commands._demo_vllm import VllmServer
    from kvdiag.demo.vllm_env import SETUP_HINT, vllm_python
    from kvdiag.demo.smollm import resolve_model

    python = vllm_python()
    if python is None:
        print(SETUP_HINT, file=sys.stderr)
        return 1
    model = resolve_model(None)
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-vllm-"))
    if args.compare == "shadow":
        servers = {"shadow": VllmServer(python, model, tmp / "shadow.kvlog", plugin=True,
                                        extra_env={"KVDIAG_SHADOW": "1", **shadow_env}),
                   "no-shadow": VllmServer(python, model, tmp / "no-shadow.kvlog", plugin=True,
                                           extra_env={"KVDIAG_SHADOW": "0"})}
        conditions, baseline, goals = ("shadow", "no-shadow"), "no-shadow", [Goal("shadow", 0.98)]
    else:
        servers = {"plugin": VllmServer(python, model, tmp / "plugin.kvlog", plugin=True),
                   "plain": VllmServer(python, model, tmp / "plain.kvlog", plugin=False)}
        conditions, baseline = ("plugin", "plain", "plain+attach"), "plain"
        goals = [Goal("plugin", 0.98), Goal("plain+attach", 0.99)]
    perf_note = perf_instructions_available()
    gaps: dict[str, list[float]] = {}

    def run_round(cond: str, r: int) -> RoundCost:
        server = servers[cond if cond in servers else "plain"]
        # every condition starts after the same pause: attach's start-up (probes done, py-spy
        # sampling) must not be the only idle gap before a measured round
        attached = Attached(server.proc.pid, tmp / f"attach-{r}.kvlog") if cond == "plain+attach" else nullcontext()
        with attached:
            time.sleep(3.0)
            cpu0 = tree_cpu_s(server.proc.pid)
            tokens = 0
            with InstructionCounter(tree_pids(server.proc.pid), perf_note is None) as counter:
                for system, question in round_prompts(r, args.requests):
                    # a distinct round prefix per condition so each server starts the round cold
                    n, g = stream_chat(server.base_url, str(model), f"[{cond}] {system}", question, args.max_tokens)
                    tokens += n
                    gaps.setdefault(cond, []).extend(g)
            return RoundCost(tokens, tree_cpu_s(server.proc.pid) - cpu0, counter.count)

    try:
        for s in servers.values():  # one at a time: two compiling at once double the wait
            s.start()
            s.wait_ready()
        res = run_interleaved(conditions, baseline, args.rounds, run_round)
    finally:
        for s in servers.values():
            s.stop()
    res.perf_note = perf_note
    p99_base = float(np.percentile(gaps[baseline], 99))
    p99 = {c: f"{float(np.percentile(gaps[c], 99)) / p99_base:.3f}" for c in res.conditions}
    if shadow_env:
        print(f"shadowed server's extra environment: {shadow_env}")
    print(report(res, goals, extra={"P99 ITL ratio": p99}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
