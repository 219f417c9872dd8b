"""The KV block pool: the incremental ledger every view reads, the engine's prefix cache from
its KV events, chained content hashing of token blocks, the KV shape of a model (bytes per
token) and the memory-pressure forecast.

May import :mod:`kvdiag.events` and :mod:`kvdiag.paths` only.
"""
