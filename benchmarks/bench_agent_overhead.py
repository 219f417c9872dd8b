"""What kvdiag costs the embedded engine: its agent inside, and `kvdiag attach` outside.

    python benchmarks/bench_agent_overhead.py [--rounds 12] [--requests 8] [--clients 4]

Two servers of the embedded model (transformers' continuous batching, SmolLM2-135M, one torch
thread each) up side by side with the same settings: ``agent`` is the demo's server
(``python -m kvdiag.run ... -- transformers serve ...``: the agent records every block and
step into a log), ``plain`` is the same ``transformers serve`` command without kvdiag. Three
conditions, interleaved round by round by the harness (benchmarks/overhead.py): ``plain``,
``plain+attach`` (``kvdiag attach PID`` running on the plain server: /proc, py-spy at its
default rate) and ``agent``. Each round sends the same seeded chats (``--requests``, greedy,
``--clients`` at a time, so the engine batches) to each condition, with a system prompt
prefixed by the condition's name so that no condition reuses another's prefix cache.

Cost = CPU seconds of the server's process tree per completion token (kvdiag attach's own
process is not counted: the question is what the target pays). Goals: agent costs <= 2%,
attach <= 5% (tokens per CPU-second >= 0.98 and 0.95 of plain), each stated met, missed or
undecided with its 95% interval.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

from overhead import Attached, Goal, InstructionCounter, RoundCost, perf_instructions_available, report, \
    round_prompts, run_interleaved, tree_cpu_s, tree_pids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--requests", type=int, default=8, help="chats per condition and round")
    ap.add_argument("--clients", type=int, default=4, help="chats in flight at once")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    from kvdiag.demo.server_process import ServerProcess, free_port
    from kvdiag.commands.demo import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_NUM_BLOCKS, DEFAULT_PAGE_SIZE, DemoServer
    from kvdiag.demo.smollm import ensure_model
    from kvdiag.demo.traffic import chat

    model_dir = ensure_model()
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-agent-"))
    agent = DemoServer(model_dir, tmp / "agent.kvlog", free_port(), DEFAULT_PAGE_SIZE, DEFAULT_NUM_BLOCKS,
                       DEFAULT_MAX_BATCH_TOKENS, inject_leak=0, threads=1)

    class PlainServer(ServerProcess):
        """The agent server's ``transformers serve`` command, run without kvdiag."""

        def __init__(self) -> None:
            port = free_port()
            serve = agent.command[agent.command.index("--") + 1:]
            serve[0] = str(Path(sys.executable).with_name("transformers"))
            serve[serve.index("--port") + 1] = str(port)
            self.command, self.env = serve, agent.env
            self.base_url = f"http://127.0.0.1:{port}"
            self.server_log = tmp / "plain.server.txt"

    plain = PlainServer()
    perf_note = perf_instructions_available()
    for s in (plain, agent):  # one at a time: two loading at once only doubles the wait
        s.start()
        s.wait_ready(300)

    def run_round(cond: str, r: int) -> RoundCost:
        server = agent if cond == "agent" else plain
        # every condition starts after the same pause: attach's start-up (probes done, py-spy
        # sampling) must not be the only idle gap before a measured round
        attached = Attached(server.proc.pid, tmp / f"attach-{r}.kvlog") if cond == "plain+attach" else nullcontext()
        with attached:
            time.sleep(3.0)
            return measure(server, cond, r)

    def measure(server, cond: str, r: int) -> RoundCost:
        prompts = round_prompts(r, args.requests)

        def one(i: int) -> int:
            system, question = prompts[i]
            msgs = [{"role": "system", "content": f"[{cond}] {system}"}, {"role": "user", "content": question}]
            ans = chat(server.base_url, str(model_dir), msgs, args.max_tokens, f"{cond}-{r}-{i}")
            return int(ans["usage"]["completion_tokens"])

        cpu0 = tree_cpu_s(server.proc.pid)
        with InstructionCounter(tree_pids(server.proc.pid), perf_note is None) as counter:
            with ThreadPoolExecutor(args.clients) as pool:
                tokens = sum(pool.map(one, range(args.requests)))
        return RoundCost(tokens, tree_cpu_s(server.proc.pid) - cpu0, counter.count)

    try:
        run_round("plain", -1), run_round("agent", -1)  # warm-up: first requests compile and allocate
        res = run_interleaved(("plain", "plain+attach", "agent"), "plain", args.rounds, run_round)
    finally:
        for s in (plain, agent):
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    res.perf_note = perf_note
    print()
    print(f"{args.rounds} rounds x {args.requests} chats ({args.clients} in flight, {args.max_tokens} tokens max) "
          f"per condition; cost = server process tree CPU per completion token")
    print(report(res, [Goal("agent", 0.98), Goal("plain+attach", 0.95)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
