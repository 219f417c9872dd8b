"""`kvdiag attach`'s summary as text: what ``--json`` prints as data
(:func:`kvdiag.diagnosis.attach_summary.summarize`), laid out for a person."""

from __future__ import annotations

import time


def _mib(x) -> str:
    return "N/A" if x is None else f"{x / 2**20:,.1f} MiB"


def _pct(x) -> str:
    return "N/A" if x is None else f"{x:.1%}"


def _latency_lines(lat) -> list[str]:
    """The latency block of the summary (kvdiag.diagnosis.user_latency's figures)."""
    if not lat:
        return []
    from kvdiag.diagnosis.user_latency import LABELS, METRICS, fmt_s
    o = lat["overall"]
    out = [f"latency of finished requests ({o['requests_finished']}; P50 / P99)"]
    for m in METRICS:
        st = o["stats"][m]
        out.append(f"  {LABELS[m]:<18} " + (f"{fmt_s(st['p50_s'])} / {fmt_s(st['p99_s'])} (n {st['count']})"
                                           if st["p50_s"] is not None else st["reason"]))
    rate = lambda x: "N/A" if x is None else f"{x:.2f}/s"  # noqa: E731
    out += [f"  arrivals           {rate(o['arrival_rate_per_s'])}, completions {rate(o['completion_rate_per_s'])}", ""]
    return out


def _sharing_lines(sh: dict) -> list[str]:
    """Shadow vs engine over the same requests, with the window they cover."""
    if sh.get("requests") is None:
        return []
    start = sh.get("window_start_ns")
    since = (f"since join at {time.strftime('%H:%M:%S', time.localtime(start / 1e9))}" if start
             else "since the shadow started")
    return [f"  prefix sharing     {since}, {sh['requests']} requests: engine {_pct(sh.get('engine_hit_rate'))},"
            f" shadow {_pct(sh.get('shadow_hit_rate'))}"
            + (f" (gap {sh['gap'] * 100:+.1f} pts)" if sh.get("gap") is not None else "")]


def format_summary(s: dict) -> str:
    """The human-readable summary (what --json prints as data)."""
    m, kv, hr, ph = s["memory"], s["kv"], s["hit_rate"], s["phases"]
    lines = [f"kvdiag attach: PID {s['target_pid']}, {s['window']['duration_s']:.1f} s, "
             f"{s['events']} events -> {s['log']}", "",
             *_latency_lines(s.get("latency")),
             "memory by source",
             f"  process tree RSS   {_mib(m.get('process_rss_bytes'))} (peak {_mib(m.get('process_rss_peak_bytes'))},"
             f" {m.get('processes', 'N/A')} processes)",
             f"  GPU (NVML)         {_mib(m.get('gpu_process_bytes'))} of target, {_mib(m.get('gpu_used_bytes'))} device",
             f"  CUDA allocator     {_mib(m.get('allocator_reserved_bytes'))} reserved,"
             f" {_mib(m.get('allocator_allocated_bytes'))} allocated",
             f"  KV pool            {_mib(m.get('kv_used_bytes'))} used, {_mib(m.get('kv_cached_bytes'))} cached,"
             f" {_mib(m.get('kv_pool_bytes'))} total", "",
             "KV pool"]
    if "num_blocks" in kv:
        lines += [f"  blocks             {kv['blocks_used']} used, {kv['blocks_cached']} cached, {kv['blocks_free']} free"
                  f" of {kv['num_blocks']} (block {kv['block_size_tokens']} tokens)",
                  f"  occupancy          blocks {_pct(kv.get('block_occupancy'))}, tokens {_pct(kv.get('token_occupancy'))}"
                  f" (mean {_pct(kv.get('mean_block_occupancy'))} / {_pct(kv.get('mean_token_occupancy'))})"]
    else:
        lines.append("  N/A (no kvdiag agent events)")
    lines += [f"  block events       {kv['blocks_allocated']} allocated, {kv['blocks_released']} released,"
              f" {kv['blocks_evicted']} evicted, {kv['prefix_hits']} prefix hits",
              f"  requests finished  {kv['requests_finished']} ({kv['prompt_tokens']} prompt tokens,"
              f" {kv['output_tokens']} generated)",
              f"  prefix hit rate    {_pct(hr.get('token_hit_rate'))} of prompt tokens"
              + (f"; engine counters {_pct(hr.get('engine_hit_rate'))}" if "engine_hit_rate" in hr else ""),
              *_sharing_lines(s.get("sharing") or {}),
              f"  fragmentation      {_pct(s['fragmentation']['kv_empty_slot_share'])} empty slots in used blocks;"
              f" allocator {_pct(s['fragmentation']['allocator'])}", "",
              f"phases (py-spy, {ph['samples']} samples)"]
    if ph["shares"]:
        lines += [f"  {p:<18} {v:6.1%}" for p, v in ph["shares"].items()]
        lines += ["  hottest: " + "; ".join(f"{fn} {v:.1%}" for fn, v in ph["top_functions"][:3])]
    else:
        lines.append("  N/A" + (f" ({s['pyspy_error']})" if s.get("pyspy_error") else ""))
    lines += ["", "collectors"] + [f"  {c['collector']:<18} {'ok' if c['available'] else 'N/A'}  {c['hint']}"
                                   for c in s["collectors"]]
    lines += ["", "findings"] + [f"  [{f['status']:>4}] {f['rule']}: {f['message']}" for f in s["findings"]]
    return "\n".join(lines)
