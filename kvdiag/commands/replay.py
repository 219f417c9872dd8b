"""`kvdiag replay`: a recorded trace through shadow prefix caches. This module holds the
command's arguments and picks its mode; each mode is a module of its own: the policies' replay
(``_replay_policies``), ``--tiers`` (``_replay_tiers``), ``--similarity``
(``_replay_similarity``)."""

from __future__ import annotations

import argparse
import sys

from kvdiag.commands import _replay_policies, _replay_similarity, _replay_tiers
from kvdiag.commands._logs import add_input_arguments
from kvdiag.commands._replay_common import parse_capacity

__all__ = ["DESCRIPTION", "add_arguments", "parse_capacity", "run"]

DESCRIPTION = """\
Replay a trace through shadow prefix caches and print hit rates per policy and capacity.

A request reuses the longest run of its leading blocks that are cached (chained content keys:
equal keys = equal prefixes) and stops at the first miss; then all its blocks are touched or
inserted and the cache evicts to its capacity.

  block hit rate   = prefix-hit blocks / referenced blocks
  token hit rate   = hit tokens / prompt tokens (a hit block counts min(block size,
                     remaining prompt) tokens; prompt tails shorter than a block never hit)
  request hit rate = mean over requests of (request's hit tokens / its prompt tokens)
  bytes saved      = hit tokens x KV bytes per token (KV not recomputed)
  memory reduction = 1 - peak blocks held by live requests with sharing / without

Policies: lru, fifo, lfu, s3fifo, opt (Belady, the upper bound); plug-ins written in Python:
lecar (regret-weighted LRU/LFU), prefix-lru (evicts chain tails first), lru-plugin,
fifo-plugin, lfu-plugin (the classics in the plug-in API), and your own with --policy-file
(docs/policies.md).
Formats (auto-detected): kvdiag (event log), mooncake, tokens ({"timestamp", "token_ids"}
JSONL), vllm (KV events JSONL). A kvdiag log recorded by default holds salted hashes of
16-token chunks instead of token ids: --block-size must then be a multiple of 16, and the
rows are those the token ids would give.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", help="trace file (.gz too)")
    parser.add_argument("--format", choices=("kvdiag", "mooncake", "tokens", "vllm"),
                        help="input format (default: detected from the first line)")
    parser.add_argument("--block-size", type=int, metavar="N",
                        help="block size in tokens to re-chunk token ids at (default: the "
                             "engine's, 16 for token-id traces, 512 for Mooncake)")
    parser.add_argument("--policy", action="append", metavar="P",
                        choices=("lru", "fifo", "lfu", "s3fifo", "opt", "lecar", "prefix-lru",
                                 "lru-plugin", "fifo-plugin", "lfu-plugin"),
                        help="eviction policy; repeat for several (default: lru, or lru, "
                             "s3fifo and opt beside --policy-file)")
    parser.add_argument("--policy-file", action="append", metavar="FILE",
                        help="a Python file defining kvdiag.simulation.policies.Policy subclasses "
                             "to replay too (it is code and runs as you: see docs/policies.md); "
                             "repeat for several")
    parser.add_argument("--capacity", action="append", metavar="C",
                        help="cache capacity: blocks (1000), bytes (4GiB, 500MB) or "
                             "'unbounded'; repeat for several (default: unbounded)")
    parser.add_argument("--bytes-per-token", type=int, metavar="B",
                        help="KV bytes per token over all layers, K and V (default: the log "
                             "header's); needed for capacities in bytes and bytes saved")
    parser.add_argument("--hash", choices=("fast", "blake2b", "sha256"), default="fast",
                        help="chunk hash for token ids (default: fast; a hashed log keeps its own)")
    parser.add_argument("--concurrency", type=int, default=8, metavar="N",
                        help="for traces without finish times: a request holds its blocks "
                             "until N later requests arrived (memory reduction; default 8)")
    parser.add_argument("--curve", action="store_true",
                        help="hit rate vs capacity (LRU in one pass; other policies per point)")
    parser.add_argument("--similarity", action="store_true",
                        help="cosine similarity of K/V at the first positions of requests "
                             "with and without a shared prompt, on the real model (kvdiag logs "
                             "recorded with --record-tokens: it needs the token ids)")
    parser.add_argument("--positions", type=int, default=10, metavar="N",
                        help="positions compared by --similarity (default 10)")
    parser.add_argument("--offset", type=int, default=0, metavar="N",
                        help="--similarity compares positions N..N+positions-1 (default 0)")
    parser.add_argument("--min-shared-tokens", type=int, default=16, metavar="N",
                        help="--similarity: two requests share a system prompt when their first "
                             "N tokens are equal (default 16)")
    parser.add_argument("--tiers", metavar="SPEC",
                        help="tiered what-if instead of policies: NAME=CAP[,BW],... top tier "
                             "first, e.g. gpu=2000,cpu=40GiB,25GB/s,disk=unbounded,3GB/s; CAP in "
                             "blocks, bytes (needs the bytes per token) or unbounded; BW = bytes/s "
                             "of reading the tier into the top one (docs/tiers.md)")
    parser.add_argument("--tier-write", choices=("back", "through"), default="back",
                        help="lower tiers: write-back (a block goes down only when evicted; "
                             "default) or write-through (every new block is stored below at once)")
    parser.add_argument("--prefill-s-per-token", type=float, metavar="S",
                        help="--tiers: prefill seconds per prompt token (default: fitted on a "
                             "kvdiag log's engine steps)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of a table: the trace's counts, "
                             "\"rows\" (one per policy and capacity, or curve point) and "
                             "\"skipped_lines\" ({\"count\", \"first\"})")
    add_input_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Parse the capacities, then hand over to the mode asked for: ``--similarity``
    (:mod:`._replay_similarity`), ``--tiers`` (:mod:`._replay_tiers`), else the policies'
    replay (:mod:`._replay_policies`)."""
    from kvdiag.traces.lines import ReadOptions

    read = ReadOptions(strict=args.strict, partial=args.partial)
    try:
        caps = [parse_capacity(c) for c in (args.capacity or ["unbounded"])]
    except ValueError as exc:
        print(f"kvdiag replay: {exc}", file=sys.stderr)
        return 2
    if args.similarity:
        return _replay_similarity.run(args, read)
    if args.tiers:
        return _replay_tiers.run(args, read)
    return _replay_policies.run(args, read, caps)
