"""Collectors: engine adapters (vLLM's plugin hooks and KV events, transformers' continuous
batching), the allocator, release paths, NVML, RAPL, /proc, py-spy, the memory-bandwidth probe
and the agent's socket client turn what a serving process does into events.

May import :mod:`kvdiag.shadow` and the layers below it; not the agent that installs them (it is
handed in) and not the analyses.
"""
