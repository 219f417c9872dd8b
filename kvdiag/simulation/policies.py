"""Replacement policies as Python plug-ins: the API, and LRU, FIFO and LFU written in it.

A policy is a subclass of :class:`Policy` with three hooks the replay calls, per block
reference, under the prefix-cache semantics of :mod:`kvdiag.simulation.sharing`:

- ``on_hit(block, ref)``: a cached block is referenced again;
- ``victim(ref) -> block``: the cache is full and ``ref``'s block must be inserted: return
  a cached block to evict (the replay then calls ``on_evict(block, ref)``);
- ``on_insert(block, ref)``: a block that was not cached is inserted.

Blocks are dense integer ids (``0..distinct blocks - 1``). ``ref`` (:class:`Ref`) is the
reference being replayed: its request, the block's position in that request's prompt, its
tokens and the reference clock. :class:`BlockStats` (``self.blocks``) has what the replay keeps
per block: references since insertion (reuse count + 1), insertion and last-use clocks (age =
``ref.time - last_used``), position and tokens at the last reference, and the parent block
(the one before it in a prompt: the prefix chain).

The three built-in plug-ins below reproduce the numba fast paths exactly (same victims, same
hits; ``tests/integration/test_policies.py``). A policy file for ``kvdiag replay --policy-file`` is Python
code, run with your permissions: load only files you would run yourself.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict


class Ref:
    """The block reference being replayed (one object, updated in place between calls: copy
    the fields you keep). ``request``: the replayed row's index (0-based, trace order: each
    request is a row; kvdiag logs have rows for the blocks a request adds when it finishes
    too, with ``lookup`` False); ``position``: the block's index in that request's prompt (0 = the chain's head);
    ``tokens``: prompt tokens the block holds; ``time``: references replayed so far,
    this one included (the clock ages are measured in); ``lookup``: False for the rows of
    blocks a request adds when it finishes (kvdiag logs), which are inserted, never looked up."""

    __slots__ = ("request", "position", "tokens", "time", "lookup")

    def __init__(self) -> None:
        self.request = 0
        self.position = 0
        self.tokens = 0
        self.time = 0
        self.lookup = True


class BlockStats:
    """Per-block metadata the replay maintains (lists indexed by block id).

    ``refs[b]``: references to ``b`` since its last insertion, that one included (reuse count
    = ``refs[b] - 1``); ``inserted_at[b]`` / ``last_used[b]``: clock (:attr:`Ref.time`) of its
    insertion / last reference; ``last_request[b]``: request of its last reference;
    ``position[b]`` / ``tokens[b]``: at its last reference; ``parent[b]``: the block before it
    in the first prompt that referenced it (-1 for a head), the prefix chain's link;
    ``cached[b]``: 1 while ``b`` is in the cache.
    """

    def __init__(self, num_blocks: int) -> None:
        n = max(int(num_blocks), 1)
        self.refs = [0] * n
        self.inserted_at = [0] * n
        self.last_used = [0] * n
        self.last_request = [0] * n
        self.position = [0] * n
        self.tokens = [0] * n
        self.parent = [-2] * n  # -2: never seen
        self.cached = bytearray(n)

    def age(self, block: int, now: int) -> int:
        """References replayed since ``block`` was last referenced."""
        return now - self.last_used[block]


class Policy:
    """Base class of a replacement policy plug-in. Override ``on_hit``, ``on_insert`` and
    ``victim`` (``on_evict`` to forget the victim, ``reset`` to set up state).

    ``name`` labels the policy's rows in ``kvdiag replay`` (default: the class name, lower
    case). A policy instance replays one (trace, capacity); the replay makes a fresh one per
    run by calling the class with no arguments.
    """

    name: str = ""

    def reset(self, capacity_blocks: int, blocks: BlockStats) -> None:
        """Called once before the replay (``capacity_blocks`` > 0)."""
        self.capacity_blocks = capacity_blocks
        self.blocks = blocks

    def on_hit(self, block: int, ref: Ref) -> None:
        """A cached block is referenced (``blocks`` already counts this reference)."""

    def on_insert(self, block: int, ref: Ref) -> None:
        """A block that was not cached is inserted (after any eviction)."""

    def victim(self, ref: Ref) -> int:
        """A cached block to evict so that ``ref``'s block fits."""
        raise NotImplementedError

    def on_evict(self, block: int, ref: Ref) -> None:
        """``block`` (the last :meth:`victim`) has left the cache."""

    @classmethod
    def label(cls) -> str:
        return cls.name or cls.__name__.lower()


class StaleHeap:
    """A min-heap of ``(key..., block)`` tuples where a block's outdated entries stay behind
    and are skipped: ``is_current(entry)`` says whether an entry still holds. Push a new entry
    whenever a block's key changes. Outdated entries are dropped whenever the heap has grown
    to twice its current entries (+4096), so memory follows the cache, not the trace."""

    def __init__(self, is_current) -> None:
        self.items: list[tuple] = []
        self.is_current = is_current
        self._limit = 4096

    def push(self, entry: tuple) -> None:
        heapq.heappush(self.items, entry)
        if len(self.items) > self._limit:
            self.items = [e for e in self.items if self.is_current(e)]
            heapq.heapify(self.items)
            self._limit = 2 * len(self.items) + 4096

    def top(self) -> tuple:
        """The smallest current entry (IndexError when there is none)."""
        items, is_current = self.items, self.is_current
        while not is_current(items[0]):
            heapq.heappop(items)
        return items[0]

    def pop(self) -> tuple:
        """Remove and return the smallest entry (call :meth:`top` first)."""
        return heapq.heappop(self.items)


class LRUPolicy(Policy):
    """Least recently used: evict the block referenced longest ago."""

    name = "lru-plugin"

    def reset(self, capacity_blocks, blocks):
        super().reset(capacity_blocks, blocks)
        self.order = OrderedDict()  # least recent first

    def on_hit(self, block, ref):
        self.order.move_to_end(block)

    def on_insert(self, block, ref):
        self.order[block] = None

    def victim(self, ref):
        return next(iter(self.order))

    def on_evict(self, block, ref):
        del self.order[block]


class FIFOPolicy(LRUPolicy):
    """First in, first out: evict the block inserted longest ago (hits change nothing)."""

    name = "fifo-plugin"

    def on_hit(self, block, ref):
        pass


class LFUPolicy(Policy):
    """Least frequently used: fewest references since insertion; ties: least recently used
    (a heap with stale entries skipped)."""

    name = "lfu-plugin"

    def reset(self, capacity_blocks, blocks):
        super().reset(capacity_blocks, blocks)
        self.heap = StaleHeap(self._is_current)  # (refs, last used, block)

    def _is_current(self, entry) -> bool:
        refs, used, block = entry
        blocks = self.blocks
        return bool(blocks.cached[block]) and blocks.refs[block] == refs and \
            blocks.last_used[block] == used

    def on_hit(self, block, ref):
        self.heap.push((self.blocks.refs[block], ref.time, block))

    on_insert = on_hit

    def victim(self, ref):
        return self.heap.top()[2]

    def on_evict(self, block, ref):
        self.heap.pop()  # the victim is the heap's top


BUILTIN_PLUGINS = {p.name: p for p in (LRUPolicy, FIFOPolicy, LFUPolicy)}
