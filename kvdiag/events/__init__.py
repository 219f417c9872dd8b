"""The event store: the one versioned event schema, the sinks events go to, the crash-safe JSONL
event log, Arrow/Parquet datasets, and the allocator snapshot files read with them.

Bottom layer: imports nothing of kvdiag but :mod:`kvdiag.paths`.
"""
