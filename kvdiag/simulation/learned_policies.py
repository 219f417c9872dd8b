"""Two policies beyond the classics, written as plug-ins (:mod:`kvdiag.simulation.policies`).

- ``lecar``: LeCaR (Vietri et al., HotStorage 2018), an online learner: two experts, LRU and
  LFU, with weights; each eviction follows one expert drawn by weight (a seeded generator, so
  replays repeat) and, when the experts disagree, the victim goes into that expert's history
  of recent evictions. A miss on a block in an expert's history is that expert's regret: its
  weight shrinks by ``exp(-learning_rate x discount^(references since the eviction))``.
- ``prefix-lru``: prefix-aware LRU. Under prefix matching a block is useless once the block
  before it in its chain is gone, and a request touches its chain head first, so plain LRU
  evicts the head, the block every sharer needs, before the tail. This policy evicts only
  leaves (cached blocks with no cached successor in the chain), least recently used first:
  tails go first, shared heads stay while anything hangs from them.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from kvdiag.simulation.policies import Policy, StaleHeap


class LeCaRPolicy(Policy):
    """Regret-weighted choice between LRU and LFU (LeCaR). ``weights`` = [LRU, LFU]. As in
    LeCaR, a block's frequency survives its eviction while it is in a history: a block that
    returns from there resumes its count (+1)."""

    name = "lecar"
    learning_rate = 0.45
    seed = 0

    def reset(self, capacity_blocks, blocks):
        super().reset(capacity_blocks, blocks)
        self.weights = [0.5, 0.5]
        self.discount = 0.005 ** (1.0 / max(capacity_blocks or 1, 1))
        self.recency = OrderedDict()  # least recent first
        self.frequency = StaleHeap(self._is_current)  # (count, last used, block)
        self.count: dict[int, int] = {}  # cached blocks' frequency
        self.history = (OrderedDict(), OrderedDict())  # per expert: block -> (evicted, count)
        self.random = random.Random(self.seed)

    def on_hit(self, block, ref):
        self.recency.move_to_end(block)
        count = self.count[block] = self.count[block] + 1
        self.frequency.push((count, ref.time, block))

    def on_insert(self, block, ref):
        count = 1
        for expert, history in enumerate(self.history):
            past = history.pop(block, None)
            if past is not None:  # that expert's mistake: shift weight away from it
                evicted_at, count = past[0], past[1] + 1
                regret = self.discount ** (ref.time - evicted_at)
                self.weights[expert] *= math.exp(-self.learning_rate * regret)
                total = self.weights[0] + self.weights[1]
                self.weights = [w / total for w in self.weights]
        self.recency[block] = None
        self.count[block] = count
        self.frequency.push((count, ref.time, block))

    def _is_current(self, entry) -> bool:
        count, used, block = entry
        return self.count.get(block) == count and self.blocks.last_used[block] == used

    def victim(self, ref):
        by_recency = next(iter(self.recency))
        by_frequency = self.frequency.top()[2]
        expert = 0 if self.random.random() < self.weights[0] else 1
        chosen = (by_recency, by_frequency)[expert]
        if by_recency != by_frequency:
            history = self.history[expert]
            history[chosen] = (ref.time, self.count[chosen])
            if len(history) > self.capacity_blocks:
                history.popitem(last=False)
        return chosen

    def on_evict(self, block, ref):
        del self.recency[block]
        del self.count[block]


class PrefixLRUPolicy(Policy):
    """Evict the least recently used leaf of the prefix chains (a cached block no cached
    block follows); a block with cached successors is kept."""

    name = "prefix-lru"

    def reset(self, capacity_blocks, blocks):
        super().reset(capacity_blocks, blocks)
        self.successors: dict[int, set[int]] = {}  # block -> blocks whose parent it is
        self.cached_successors: dict[int, int] = {}
        self.leaves = StaleHeap(self._is_current)  # (last used, block)

    def _is_current(self, entry) -> bool:
        used, block = entry
        return bool(self.blocks.cached[block]) and not self.cached_successors.get(block) and \
            self.blocks.last_used[block] == used

    def on_hit(self, block, ref):
        if not self.cached_successors.get(block):
            self.leaves.push((ref.time, block))

    def on_insert(self, block, ref):
        blocks = self.blocks
        parent = blocks.parent[block]
        if parent >= 0:
            self.successors.setdefault(parent, set()).add(block)
            if blocks.cached[parent]:
                self.cached_successors[parent] = self.cached_successors.get(parent, 0) + 1
        held = sum(blocks.cached[k] for k in self.successors.get(block, ()))
        self.cached_successors[block] = held
        if not held:
            self.leaves.push((ref.time, block))

    def victim(self, ref):
        return self.leaves.top()[1]

    def on_evict(self, block, ref):
        self.leaves.pop()  # the victim is the heap's top
        parent = self.blocks.parent[block]
        if parent >= 0 and self.blocks.cached[parent]:
            left = self.cached_successors[parent] - 1
            self.cached_successors[parent] = left
            if not left:
                self.leaves.push((self.blocks.last_used[parent], parent))


LEARNED_POLICIES = {p.name: p for p in (LeCaRPolicy, PrefixLRUPolicy)}
