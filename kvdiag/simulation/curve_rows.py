"""The rows a live capacity curve (:class:`kvdiag.simulation.capacity_curve.ReuseCurve`) is fed,
built from an event stream as ``kvdiag replay --curve`` builds them: request content
(:class:`RequestRows`) and one tier's KV events (:class:`StoreRows`, which also counts the
tier's stored, removed and resident blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from kvdiag.simulation.capacity_curve import ReuseCurve
from kvdiag.traces.kvdiag_logs import full_sequence
from kvdiag.pool.hashing import Content, chunk_hashes, full_sequence_chunks

MAX_LIVE = 1 << 16
"""Requests in flight whose content :class:`RequestRows` keeps for their finish row."""
MAX_CHAIN = 1 << 17
"""KV-event keys whose parent and tokens :class:`StoreRows` keeps to resolve chains."""


class RequestRows:
    """Rows from a kvdiag event stream's request content, as ``load_kvdiag`` builds them: a
    counted row at ``RequestArrived`` (token ids or hashes-mode chunk keys, re-chunked at
    ``block_size_tokens``), an uncounted one at ``RequestFinished`` (prompt and generated
    content from the request's ``BlockStored`` events). At most MAX_LIVE requests in flight
    are kept (the oldest dropped)."""

    def __init__(self, curve: ReuseCurve, hash_algorithm: str = "fast") -> None:
        self.curve = curve
        self.hash_algorithm = hash_algorithm
        self._live: OrderedDict[str, tuple[Content, list]] = OrderedDict()  # at most MAX_LIVE
        self.skipped = 0  # requests whose content cannot be keyed at the block size

    def arrived(self, ev) -> None:
        if ev.request_id in self._live:  # a repeated arrival of a request in flight
            return
        content = Content.of_arrival(ev)  # the one reader (its keys shared with the miss causes)
        if content is None:
            return
        bs = self.curve.block_size_tokens
        if not content.can_key(bs):
            self.skipped += 1
            return
        self.curve.add(content.keys(bs, self.hash_algorithm), ev.prompt_tokens)
        self._live[ev.request_id] = (content, [])
        if len(self._live) > MAX_LIVE:  # never finished: its finish row is lost
            self._live.popitem(last=False)

    def stored(self, ev) -> None:
        live = self._live.get(ev.request_id) if ev.request_id is not None else None
        if live is None:
            return
        if live[0].token_ids is not None and ev.token_ids is not None and len(ev.token_ids):
            live[1].append(list(ev.token_ids))
        elif live[0].token_ids is None and ev.chunk_hashes is not None:
            live[1].append((int(ev.num_tokens), list(ev.chunk_hashes)))

    def finished(self, ev) -> None:
        live = self._live.pop(ev.request_id, None)
        if live is None:
            return
        prompt, stored = live
        bs = self.curve.block_size_tokens
        if not stored:  # full_sequence of no stored block: the prompt alone, keyed at its arrival
            keys = prompt.keys(bs, self.hash_algorithm)
        elif prompt.token_ids is not None:
            keys = chunk_hashes(full_sequence(prompt.token_ids, stored), bs,
                                algorithm=self.hash_algorithm)
        else:
            chunks, _ = full_sequence_chunks(prompt.chunk_keys, prompt.num_tokens, stored)
            keys = Content(0, chunk_keys=chunks).keys(bs)
        self.curve.add(keys, 0, counted=False)


class StoreRows:
    """Rows from KV events of one tier, as ``load_vllm`` builds them: each
    ``PrefixCacheStored`` is a row of its parent chain's tokens and its own, re-chunked at the
    curve's block size. The chain table holds at most ``max_chain`` keys (default: the
    curve's bound, at most MAX_CHAIN; each with its block's token ids; the oldest dropped: a
    chain through a dropped key starts there, and the curve is no longer replay's)."""

    def __init__(self, curve: ReuseCurve, hash_algorithm: str = "fast",
                 max_chain: Optional[int] = None) -> None:
        self.curve = curve
        self.hash_algorithm = hash_algorithm
        self.max_chain = max_chain or min(curve.max_keys, MAX_CHAIN)
        self._chains: OrderedDict[int, tuple[Optional[int], list]] = OrderedDict()
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.resident_blocks = 0  # stored - removed, floored at 0
        self.peak_resident_blocks = 0

    def stored(self, ev) -> None:
        chains = self._chains
        hashes, parent, tokens, bs = ev.block_hashes, ev.parent_hash, ev.token_ids, ev.block_size_tokens
        parts, seen, p = [], set(), parent
        while p is not None and p in chains and p not in seen:
            seen.add(p)
            p, toks = chains[p]
            parts.append(toks)
        prefix = [t for toks in reversed(parts) for t in toks]
        for i, h in enumerate(hashes):
            chains[h] = (parent if i == 0 else hashes[i - 1], list(tokens[i * bs:(i + 1) * bs]))
        while len(chains) > self.max_chain:
            chains.popitem(last=False)
        seq = prefix + list(tokens)
        self.curve.add(chunk_hashes(seq, self.curve.block_size_tokens,
                                    algorithm=self.hash_algorithm), len(seq))
        self.stored_blocks += len(hashes)
        self.resident_blocks += len(hashes)
        self.peak_resident_blocks = max(self.peak_resident_blocks, self.resident_blocks)

    def removed(self, ev) -> None:
        self.removed_blocks += len(ev.block_hashes)
        self.resident_blocks = max(0, self.resident_blocks - len(ev.block_hashes))

    def cleared(self) -> None:
        self.resident_blocks = 0
