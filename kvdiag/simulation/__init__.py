"""What-if simulation over traces: the prefix-cache simulator and its numba loops, replacement
policies and their replay, cache tiers, the concurrency and capacity plan, and ``live_sharing``,
the one stateful piece: a sink that runs the same simulation incrementally on arriving prompts.

May import :mod:`kvdiag.traces` and the layers below it.
"""
