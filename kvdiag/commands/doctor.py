"""`kvdiag doctor (LOG | --pid PID)`: the memory-leak and P99-spike checklists as rules."""

from __future__ import annotations

import argparse
import json
import math
import sys

from kvdiag.diagnosis import rules
from kvdiag.collectors.agent_client import HEADER_TIMEOUT_S, NO_ENGINE_EXIT
from kvdiag.commands._logs import (add_input_arguments, fail, read_logs,
                                   skipped_lines, tell_skipped)
from kvdiag.events.eventlog import LogFormatError
from kvdiag.paths import open_private

DESCRIPTION = f"""Run the checks on a recorded log (or several: one per node); `kvdiag top`'s alerts
are these same rules over the events it has seen (kvdiag/diagnosis/rules.py defines them):

latency       printed first: TTFT, TPOT (inter-token), queue wait and end to end of finished
              requests (count, P50, P99), arrival vs completion rate; latency.queueing warns
              when queue wait is >= {rules.QUEUE_SHARE_LIMIT:.0%} of TTFT at the median (and >= {rules.QUEUE_WAIT_FLOOR_NS / 1e9:g} s) or
              arrivals outpace completions {rules.OVERLOAD_RATIO:g}x, and fails on both
memory leak   memory grows without matching KV growth; release paths not firing for finished
              requests (within {rules.RELEASE_GRACE_NS / 1e9:g} s); blocks released twice; occupancy growing at
              constant load; fragmentation >= {rules.FRAGMENTATION_LIMIT:.0%}; OOMs and allocator retries
P99 spike     a P99 rise of TTFT, TPOT or engine steps beyond {rules.P99_THRESHOLD:+.0%} (inside the log, or
              against --baseline; with too few samples for P99, a P90/P50 rise beyond
              {rules.GROSS_SHIFT_THRESHOLD:+.0%} between the log's halves, else n/a), attributed to: queueing,
              compression path active, KV bandwidth utilisation rose, prefix hit rate dropped,
              long sequences, memory pressure / preemptions / evictions, fragmentation; the
              article's four questions (compression, memory bandwidth, hit rate, long
              sequences) are listed after the table, each with its status
forecast      KV the active requests still need against free blocks: time to full, OOM risk
sharing       the engine's prefix hit rate against the content's (shadow cache at the engine's
              settings), within ±{rules.SHARING_GAP_LIMIT:.0%}, with the engine's evictions over the same requests
              beside a gap (pool pressure); preemptions
engine        the engine's own numbers against kvdiag's recount (engine.number_traps): a usage
              gauge counting blocks, a gauge whose scrapes miss the peak, a lifetime hit rate
              holding earlier traffic, hits beyond the requests' first admissions, a hit
              counter stuck at 0
misses        why prompt tokens missed the engine's prefix cache, per --miss-window-s window:
              cold, evicted, hash_domain, below_block, preemption, in_flight, engine_skip, unknown
              (kvdiag/diagnosis/miss_causes.py defines each); they sum to the engine's missed tokens

With --snapshot FILE (a torch.cuda.memory._snapshot() pickle or kvdiag's JSON of one, alone or
with LOGs) the allocator fragmentation rule also reads the snapshot; the file is untrusted:
no code in it runs, and a malformed, crafted or too deeply nested one is a one-line error.

Each rule is pass, warn, fail or n/a (no data) with its evidence.
Exit status: 0 when no rule fails, 1 when one fails, 2 on bad input (a log or snapshot that
cannot be read, or with --strict a skipped line); with --pid also 2 when there is no such
process or its agent is not answering (no header within {HEADER_TIMEOUT_S:g} s), and
{NO_ENGINE_EXIT} when PID serves no recognised engine: no kvdiag agent in its process tree. PID
may be any process of the served tree (`kvdiag demo`, the server, an engine child)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="*", metavar="LOG",
                        help="event logs, or Parquet datasets of `kvdiag export` (folders, or a quoted glob)")
    parser.add_argument("--pid", type=int, default=None,
                        help="diagnose a running server (run under the kvdiag agent) instead: any PID "
                             "of its process tree (kvdiag demo, the server, an engine child)")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="with --pid: how long to record its live events (default 30)")
    parser.add_argument("--socket", default=None, help="with --pid: the agent's socket path")
    parser.add_argument("--baseline", nargs="+", metavar="LOG", default=None,
                        help="compare latency against these logs")
    parser.add_argument("--json", action="store_true", help="findings as JSON on stdout")
    parser.add_argument("--miss-window-s", type=float, default=60.0, metavar="S",
                        help="window of the miss-causes table (default 60 s)")
    parser.add_argument("--snapshot", metavar="FILE", default=None,
                        help="a CUDA allocator snapshot (pickle or JSON) for the fragmentation rule")
    parser.add_argument("--prometheus-rules", nargs="?", const="-", metavar="FILE", default=None,
                        help="write these rules as Prometheus alerting rules over kvdiag's exported "
                             "metrics (same thresholds) to FILE (default: stdout), and exit")
    add_input_arguments(parser)


def _clean(x):
    """JSON-safe: NaN and infinities become null, numpy scalars plain numbers."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _snapshot(path: str):
    """(summary, fragmentation finding) of a snapshot file; raises ``ValueError`` with a
    one-line message naming the file."""
    from kvdiag.diagnosis.fragmentation import (SnapshotInvariantError, allocator_fragmentation_finding,
                                               snapshot_summary)
    from kvdiag.events.snapshot_io import load_snapshot
    snap = load_snapshot(path)  # SnapshotLoadError: "path: ..."
    try:
        return snapshot_summary(snap), allocator_fragmentation_finding(snap)
    except SnapshotInvariantError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _write_prometheus_rules(target: str) -> int:
    from kvdiag.prometheus.alert_rules import rules_yaml
    text = rules_yaml()
    if target == "-":
        sys.stdout.write(text)
        return 0
    try:
        with open_private(target, "w") as out:
            out.write(text)
    except OSError as exc:
        return fail("doctor", f"--prometheus-rules: {exc}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.prometheus_rules is not None:
        return _write_prometheus_rules(args.prometheus_rules)
    if args.pid is not None and (args.logs or args.snapshot):
        return fail("doctor", "give either LOG (and --snapshot) or --pid PID, not both")
    if args.pid is not None:
        return _live(args)
    if not args.logs and not args.snapshot:
        return fail("doctor", "expected a LOG, --snapshot FILE or --pid PID")
    snapshot = None
    if args.snapshot:
        try:
            snapshot = _snapshot(args.snapshot)
        except ValueError as exc:
            return fail("doctor", str(exc))
    findings, paths, problems, fleet, lat, misses = [], [], [], None, None, {}
    if args.logs:
        try:
            logs, problems = read_logs(args.logs, quiet=args.json, allow_truncated=args.partial,
                                       strict=args.strict)
            baseline = None
            if args.baseline:
                baseline, more = read_logs(args.baseline, quiet=True,
                                           allow_truncated=args.partial, strict=args.strict)
                problems += more
        except LogFormatError as exc:
            return fail("doctor", str(exc))
        tell_skipped("doctor", problems)
        from kvdiag.diagnosis.doctor import run_rules
        from kvdiag.diagnosis.user_latency import summarize
        from kvdiag.diagnosis.miss_replay import miss_causes_of_logs
        findings, paths = run_rules(logs, baseline)[0], list(logs.paths.values())
        lat = summarize(logs)
        misses = miss_causes_of_logs(logs, window_s=max(args.miss_window_s, 1e-3))
        if args.json:
            from kvdiag.diagnosis.fleet import fleet_for
            from kvdiag.commands._logs import expand
            fleet = fleet_for(expand(args.logs), logs.nodes)
    from kvdiag.diagnosis.findings import worst
    findings += [snapshot[1]] if snapshot else []
    status = worst(findings)
    try:
        if args.json:
            out = _json_object(status, paths, findings, problems, lat, bool(args.logs), snapshot,
                               misses, fleet)
            print(json.dumps(_clean(out), indent=1))
        else:
            _print(findings, with_checklist=bool(args.logs), latency=lat)
            _print_misses(misses)
    except BrokenPipeError:  # `kvdiag doctor LOG --json | head`: the reader left, the verdict stands
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # as Python's docs advise
    return 1 if status == "fail" else 0


def _json_object(status, paths, findings, problems, lat, checklist: bool, snapshot, misses,
                 fleet) -> dict:
    """``doctor --json``: the latency summary first (as in the text output), the verdict, the
    findings, the lines skipped, the P99 checklist (over logs), the snapshot's figures, the
    miss causes per node and, for Parquet datasets, the fleet's nodes worst first."""
    out = {} if lat is None else {"latency": lat.to_dict()}
    out.update({"status": status, "logs": paths, "findings": [f.to_dict() for f in findings],
                "skipped_lines": skipped_lines(problems)})
    if checklist:
        out["p99_checklist"] = _checklist(findings)
    if snapshot:
        out["snapshot"] = snapshot[0]
    if misses:
        out["miss_causes"] = {node: m.to_dict() for node, m in misses.items()}
    if fleet is not None:
        out["fleet"] = fleet.to_dict(orient="records")
    return out


def _checklist(findings) -> list[dict]:
    """The article's P99 checklist: each question, the rule answering it, status, measured."""
    from kvdiag.diagnosis.p99_rules import p99_checklist
    return [{"question": q, "rule": f.rule, "status": f.status, "measured": f.message}
            for q, f in p99_checklist(findings)]


def _print(findings, with_checklist: bool = False, latency=None) -> None:
    from rich.console import Console
    from rich.table import Table
    style = {"pass": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim"}
    console = Console(width=max(Console().width, 120))
    if latency is not None:  # the latency story first: what users of the server felt
        _print_latency(console, latency, next((f for f in findings if f.rule == "latency.queueing"), None), style)
    t = Table(show_lines=False, expand=True)
    for c in ("status", "rule", "check", "measured"):
        t.add_column(c, overflow="fold")
    for f in findings:
        t.add_row(f"[{style[f.status]}]{f.status.upper()}[/]", f.rule, f.title, f.message)
    console.print(t)
    if with_checklist:
        c = Table(title="P99 checklist (the article's four questions)", expand=True)
        for col in ("status", "question", "rule", "measured"):
            c.add_column(col, overflow="fold")
        for row in _checklist(findings):
            c.add_row(f"[{style[row['status']]}]{row['status'].upper()}[/]", row["question"], row["rule"],
                      row["measured"])
        console.print(c)
    for f in findings:  # name what failed: requests, blocks
        ids = f.evidence.get("requests") if f.status == "fail" else None
        if ids:
            console.print(f"[bold red]{f.rule}[/]: requests {', '.join(map(str, list(ids)[:50]))}"
                          + (" ..." if len(ids) > 50 else ""))


def _print_misses(misses: dict) -> None:
    """One table per node: missed prompt tokens per window by cause, then over the whole log in
    tokens and as a share of the missed tokens. Tokens alone in the cells and no vertical rules:
    the eleven columns fit the doctor's 120 without folding a cause's name or a figure."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from kvdiag.diagnosis.miss_tally import CAUSES
    console = Console(width=max(Console().width, 120))
    for node, m in misses.items():
        title = (f"Why prompt tokens missed the prefix cache ({node}; shadow LRU at "
                 f"{m.block_size_tokens} tokens x {m.capacity_blocks} blocks)")
        t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
        for c in ("window", "requests", "missed", *CAUSES):
            t.add_column(c, justify="left" if c == "window" else "right", no_wrap=True)
        t0 = m.windows[0].start_ns if m.windows else 0
        for w in m.windows:
            t.add_row(f"+{(w.start_ns - t0) / 1e9:g}-{(w.end_ns - t0) / 1e9:g} s", str(w.tally.requests),
                      str(w.tally.missed_tokens), *map(str, w.tally.tokens), end_section=w is m.windows[-1])
        t.add_row("all", str(m.total.requests), str(m.total.missed_tokens), *map(str, m.total.tokens))
        if m.total.missed_tokens:
            shares = m.total.shares()
            t.add_row("share", "", "100%", *(f"{shares[c]:.0%}" for c in CAUSES))
        console.print(t)
        med = m.to_dict()["total"]
        if m.total.tokens[1]:
            parts = []
            if med["evicted_median_reuse_refs"] is not None:
                parts.append(f"median reuse distance <= {med['evicted_median_reuse_refs']} block references, "
                             f"median time since last use <= {med['evicted_median_age_ms']} ms")
            if med["evicted_unknown_distance_tokens"]:
                parts.append(f"{med['evicted_unknown_distance_tokens']} tokens with no reuse distance (evicted by "
                             "the engine while the shadow held them, or beyond the shadow's evicted-key history)")
            console.print("evicted: " + "; ".join(parts))


def _print_latency(console, summary, queueing, style) -> None:
    """The latency table (:mod:`kvdiag.diagnosis.user_latency`), the rates and the queueing verdict."""
    from rich.markup import escape
    from rich.table import Table

    from kvdiag.diagnosis.user_latency import rates_line, rows
    t = Table(title="Latency of finished requests (as users saw it)")
    shown = rows(summary)
    multi = len({r["node"] for r in shown}) > 1
    for c in (["node"] if multi else []) + ["latency", "n", "P50", "P99", "note"]:
        t.add_column(c, overflow="fold", justify="right" if c in ("n", "P50", "P99") else "left")
    for r in shown:
        t.add_row(*([r["node"]] if multi else []), r["metric"], str(r["n"]), r["P50"], r["P99"], r["note"])
    console.print(t)
    for nl in ([summary.overall] if multi else []) + summary.nodes:
        console.print(escape(rates_line(nl)))
    if queueing is not None:
        console.print(f"[{style[queueing.status]}]{queueing.status.upper()}[/] latency.queueing: "
                      f"{escape(queueing.message)}")
    console.print()


def _live(args: argparse.Namespace) -> int:
    """Record ``--seconds`` of the agent's live stream of process PID into a temporary log
    (the stream's lines are log lines: the header first, then events), then diagnose it."""
    import psutil
    import tempfile
    import time
    from pathlib import Path

    from kvdiag.collectors.agent_client import (AgentConnection, AgentNotAnswering, AgentRefused,
                                                find_agent_socket, process_label)

    if args.pid <= 0 or not psutil.pid_exists(args.pid):
        return fail("doctor", f"no process with PID {args.pid}")
    path = args.socket if args.socket is not None else find_agent_socket(args.pid)
    if path is None:
        print(f"kvdiag doctor: process {process_label(args.pid)} serves no recognised engine: no kvdiag "
              f"agent in its process tree (start the server under `python -m kvdiag.run`, or record a "
              f"log and run `kvdiag doctor LOG`)", file=sys.stderr)
        return NO_ENGINE_EXIT
    deadline = time.monotonic() + args.seconds
    try:
        conn = AgentConnection(path, timeout_s=args.seconds)
    except (AgentNotAnswering, AgentRefused) as exc:
        return fail("doctor", f"{exc}; process {args.pid}")
    except OSError as exc:
        return fail("doctor", f"{path}: cannot reach a kvdiag agent in process {args.pid} ({exc.strerror or exc}); "
                    f"start the server under the agent (`python -m kvdiag.run ...`), or record a log "
                    f"and run `kvdiag doctor LOG`")
    with tempfile.TemporaryDirectory(prefix="kvdiag-doctor-") as d:
        log = Path(d) / f"pid{args.pid}.jsonl"
        with conn, open_private(log, "wb") as f:
            try:
                conn.read_header()
            except (AgentNotAnswering, AgentRefused) as exc:
                return fail("doctor", f"{exc}; process {args.pid}")
            except OSError as exc:  # AgentProtocolError, or a timeout
                return fail("doctor", f"{path}: no kvdiag agent header from process {args.pid} "
                            f"within {args.seconds:g} s ({exc})")
            f.write(conn.header_line)
            if (left := deadline - time.monotonic()) > 0:
                conn.settimeout(left)
                for line in conn.lines():  # ends at the deadline (a read times out) or EOF
                    f.write(line)
                    if (left := deadline - time.monotonic()) <= 0:
                        break
                    conn.settimeout(left)
        if not args.json:
            print(f"recorded {args.seconds:g} s of process {args.pid}", file=sys.stderr)
        args.pid, args.logs, args.partial = None, [str(log)], True  # the last line may be cut
        return run(args)
