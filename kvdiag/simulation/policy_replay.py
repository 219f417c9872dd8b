"""Replaying a trace through a plug-in policy (:mod:`kvdiag.simulation.policies`), and loading
plug-ins from a policy file.

The replay has the semantics of :func:`kvdiag.simulation.sharing.simulate` (prefix match on
arrival, then every block touched or inserted in prompt order, evicting while the cache holds
``capacity`` blocks) and returns the same :class:`~kvdiag.simulation.sharing.SharingResult`. It is
plain Python: one hook call per block reference.

A policy that raises, or returns a victim that is not a cached block, stops the replay with a
:class:`PolicyError` naming the request and, where it can, the policy file's line.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from kvdiag.simulation import _simkernels as K
from kvdiag.simulation.policies import BUILTIN_PLUGINS, BlockStats, Policy, Ref
from kvdiag.simulation.sharing import SharingResult, capacity_in_blocks, result_of_run
from kvdiag.traces.trace import Trace


class PolicyError(Exception):
    """A plug-in policy failed; the message names the file line, request and block."""


def _where(policy: Policy, exc: BaseException) -> tuple[str, str]:
    """(``file:line`` in the policy's source file, hook name) of an exception from a hook."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).name != Path(__file__).name]  # not the replay loop
    return _file_line(exc, type(policy).__module__), (frames[0].name if frames else "?")


def _file_line(exc: BaseException, module: str) -> str:
    """``file:line`` of the innermost frame of ``exc`` in ``module``'s file (else innermost)."""
    path = getattr(sys.modules.get(module), "__file__", None)
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if path and os.path.realpath(f.filename) == os.path.realpath(path)]
    frame = (mine or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"


def _victim_line(policy: Policy) -> str:
    code = type(policy).victim.__code__
    return f"{code.co_filename}:{code.co_firstlineno}"


def _is_cached(cached: bytearray, block) -> bool:
    try:
        return 0 <= block < len(cached) and bool(cached[block])
    except (TypeError, IndexError):
        return False


def simulate_policy(trace: Trace, policy_class: Callable[[], Policy],
                    capacity_blocks: Optional[int] = None, *,
                    capacity_bytes: Optional[int] = None,
                    bytes_per_token: Optional[int] = None,
                    label: Optional[str] = None, fast: bool = True) -> SharingResult:
    """Replay ``trace`` through a fresh ``policy_class()`` at one capacity (None = unbounded).

    ``fast``: the shipped learned plug-ins (``lecar``, ``prefix-lru``, exactly those classes
    with their default settings) replay in numba (:mod:`kvdiag.simulation._policykernels`),
    decision for decision the same as their Python hooks; ``fast=False`` runs the hooks.

    Raises :class:`PolicyError` when a hook raises or ``victim`` returns a block that is not
    cached.
    """
    cap = capacity_in_blocks(trace, capacity_blocks, capacity_bytes, bytes_per_token)
    if cap is not None and cap < 0:
        raise ValueError("capacity must be >= 0 blocks (None = unbounded)")
    try:
        policy = policy_class()
    except Exception as exc:
        where = _file_line(exc, getattr(policy_class, "__module__", ""))
        raise PolicyError(f"{where}: policy {getattr(policy_class, '__name__', policy_class)!r} "
                          f"raised {type(exc).__name__}: {exc} when created") from exc
    name = label or type(policy).label()
    stats = BlockStats(trace.num_blocks)
    ref = Ref()
    hits_out = np.zeros(trace.rows, dtype=np.int64)
    age_hist = np.zeros(K.AGE_BINS, dtype=np.int64)
    counts = [0, 0]  # evictions, peak cached blocks
    if fast and _fast_replay(trace, policy, cap, hits_out, age_hist, counts):
        return result_of_run(trace, name, cap, hits_out, counts[0], counts[1], age_hist,
                             bytes_per_token)
    try:
        policy.reset(cap, stats)
        _replay(trace, policy, cap, stats, ref, hits_out, age_hist, counts)
    except _InvalidVictim as bad:
        raise PolicyError(
            f"{_victim_line(policy)}: policy {name!r} returned an invalid victim "
            f"{bad.victim!r} (not a cached block id) at {_request_name(trace, bad.request)}, "
            f"inserting block {bad.block} at position {bad.position}") from None
    except Exception as exc:  # the user's code: any exception is a policy error
        where, hook = _where(policy, exc)
        at = "before the replay" if hook == "reset" else \
            f"at {_request_name(trace, ref.request)}, block {_block_at(trace, ref)} at " \
            f"position {ref.position}"
        raise PolicyError(f"{where}: policy {name!r} raised {type(exc).__name__}: {exc} in "
                          f"{hook} {at}") from exc
    return result_of_run(trace, name, cap, hits_out, counts[0], counts[1], age_hist,
                         bytes_per_token)


def _fast_replay(trace: Trace, policy: Policy, cap: Optional[int], hits_out: np.ndarray,
                 age_hist: np.ndarray, counts: list) -> bool:
    """The numba replay of a shipped learned plug-in, when ``policy`` is one (module
    :mod:`kvdiag.simulation._policykernels`); False: replay the hooks in Python."""
    from kvdiag.simulation.learned_policies import LeCaRPolicy, PrefixLRUPolicy

    kind = type(policy)
    if kind not in (LeCaRPolicy, PrefixLRUPolicy):
        return False
    if kind is LeCaRPolicy and (policy.learning_rate != LeCaRPolicy.learning_rate or policy.seed != LeCaRPolicy.seed
                                or len(trace.block_ids) >= 1 << 23):  # its heap key packs count and time
        return False
    from kvdiag.simulation import _policykernels as P

    ids = np.ascontiguousarray(trace.block_ids, dtype=np.int64)
    offsets = np.ascontiguousarray(trace.offsets, dtype=np.int64)
    capacity = -1 if cap is None else int(cap)
    hits = np.zeros(trace.rows, dtype=np.int64)
    ages = np.zeros(K.AGE_BINS, dtype=np.int64)
    if kind is PrefixLRUPolicy:
        evictions, peak, status = P.run_prefix_lru(capacity, ids, offsets, int(trace.num_blocks), hits, ages)
    else:
        discount = 0.005 ** (1.0 / max(cap or 1, 1))  # LeCaRPolicy.reset's
        draws = P.python_draws(policy.seed, len(ids) + 1) if capacity > 0 else np.zeros(1)
        weights = np.array([0.5, 0.5])
        evictions, peak, status = P.run_lecar(capacity, ids, offsets, int(trace.num_blocks), draws,
                                              float(policy.learning_rate), discount, hits, ages, weights)
    if status:
        return False
    hits_out[:] = hits
    age_hist[:] = ages
    counts[0], counts[1] = int(evictions), int(peak)
    return True


def _request_name(trace: Trace, row: int) -> str:
    """A replayed row as a person finds it: ``request N (0-based, trace order)``; in kvdiag logs,
    whose rows also hold the blocks a request adds when it finishes, N counts requests only."""
    if trace.counted is None:
        return f"request {row} (0-based, trace order)"
    number = int(trace.counted[:row + 1].sum()) - 1
    if trace.counted[row]:
        return f"request {number} (0-based, trace order)"
    return f"the blocks a request added at its finish, after request {number} arrived"


def _block_at(trace: Trace, ref: Ref) -> int:
    i = int(trace.offsets[ref.request]) + ref.position
    return int(trace.block_ids[i]) if 0 <= i < len(trace.block_ids) else -1


class _InvalidVictim(Exception):
    def __init__(self, victim, request: int, block: int, position: int) -> None:
        super().__init__()
        self.victim, self.request, self.block, self.position = victim, request, block, position


def _replay(trace: Trace, policy: Policy, cap: Optional[int], stats: BlockStats, ref: Ref,
            hits_out: np.ndarray, age_hist: np.ndarray, counts: list) -> None:
    """The reference loop (locals for speed; the semantics of ``_simkernels.run_requests``).

    Long: one loop over every block reference with its state in locals, read side by side with
    ``_simkernels.run_requests``; a helper per step would add a Python call to each reference
    of traces millions of references long, and would take a dozen locals as arguments."""
    ids = trace.block_ids.tolist()
    offsets = trace.offsets.tolist()
    tokens = trace.block_tokens.tolist()
    lookup = trace.counted_rows.tolist()
    cached = stats.cached
    refs, inserted_at, last_used = stats.refs, stats.inserted_at, stats.last_used
    last_request, position, block_tokens, parent = (stats.last_request, stats.position,
                                                    stats.tokens, stats.parent)
    on_hit, on_insert, victim, on_evict = (policy.on_hit, policy.on_insert, policy.victim,
                                           policy.on_evict)
    capacity = -1 if cap is None else cap
    held = evictions = peak = clock = 0
    for r in range(len(offsets) - 1):
        s, e = offsets[r], offsets[r + 1]
        h = K.leading_held(ids, s, e, cached)
        hits_out[r] = h
        ref.request = r
        ref.lookup = bool(lookup[r])
        before = -1
        for i in range(s, e):
            x = ids[i]
            clock += 1
            pos = i - s
            ref.position = pos
            ref.tokens = tok = tokens[i]
            ref.time = clock
            if parent[x] == -2:
                parent[x] = before if before != x else -1
            before = x
            if cached[x]:
                refs[x] += 1
                last_used[x] = clock
                last_request[x] = r
                position[x] = pos
                block_tokens[x] = tok
                on_hit(x, ref)
                continue
            if capacity == 0:
                continue
            if capacity > 0:
                while held >= capacity:
                    v = victim(ref)
                    if not _is_cached(cached, v):
                        raise _InvalidVictim(v, r, x, pos)
                    cached[v] = 0
                    held -= 1
                    evictions += 1
                    age = r - last_request[v]
                    age_hist[age.bit_length() if age > 0 else 0] += 1
                    on_evict(v, ref)
            cached[x] = 1
            held += 1
            refs[x] = 1
            inserted_at[x] = last_used[x] = clock
            last_request[x] = r
            position[x] = pos
            block_tokens[x] = tok
            on_insert(x, ref)
            if held > peak:
                peak = held
    counts[0], counts[1] = evictions, peak


# ---------------------------------------------------------------- policy files


def load_policy_file(path: str | os.PathLike) -> list[type[Policy]]:
    """The :class:`Policy` subclasses a policy file defines, in definition order.

    The file is Python code and runs with your permissions, like a plugin: load only files
    you would run yourself. Raises :class:`PolicyError` (``file:line``) when it cannot be read
    or run, or defines no policy.
    """
    path = Path(path)
    module_name = f"kvdiag_policy_file_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PolicyError(f"{path}: expected a Python file (.py) defining a kvdiag Policy")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError as exc:
        sys.modules.pop(module_name, None)
        raise PolicyError(f"{path}: cannot read the policy file ({exc.strerror})") from None
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        raise PolicyError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:
        sys.modules.pop(module_name, None)
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if os.path.exists(f.filename) and os.path.samefile(f.filename, path)]
        line = f":{frames[-1].lineno}" if frames else ""
        raise PolicyError(f"{path}{line}: the policy file raised {type(exc).__name__}: "
                          f"{exc}") from None
    found = [obj for obj in vars(module).values()
             if isinstance(obj, type) and issubclass(obj, Policy) and obj.__module__ == module_name]
    if not found:
        raise PolicyError(f"{path}: expected a subclass of kvdiag.simulation.policies.Policy, "
                          f"found none")
    return found


def plugin_by_name(name: str) -> Optional[type[Policy]]:
    """A plug-in shipped with kvdiag (``lru-plugin``, ``lecar``, ...), or None."""
    from kvdiag.simulation.learned_policies import LEARNED_POLICIES

    return {**BUILTIN_PLUGINS, **LEARNED_POLICIES}.get(name)


def simulate_plugins(trace: Trace, policies: Sequence[type[Policy]],
                     capacities: Sequence[Optional[int]], *,
                     bytes_per_token: Optional[int] = None) -> list[SharingResult]:
    """:func:`simulate_policy` for every (policy, capacity) pair, policy-major order."""
    return [simulate_policy(trace, p, c, bytes_per_token=bytes_per_token)
            for p in policies for c in capacities]
