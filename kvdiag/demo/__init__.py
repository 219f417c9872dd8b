"""What the demo runs: the embedded SmolLM2 model's files, vLLM's own environment, the
deterministic chat traffic, and the child processes (command lines, servers that are never left
behind).

May import :mod:`kvdiag.paths` only; every layer above may use it.
"""
