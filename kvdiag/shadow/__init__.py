"""Shadow measurements: runs the kernels on sampled copies of live KV within a CPU-time budget
(the runner), drives a transformers decoder for offline shadow runs, hooks the runner into
transformers' continuous batching, and words how the figures were sampled.

May import :mod:`kvdiag.kernels`, :mod:`kvdiag.pool`, :mod:`kvdiag.demo`, :mod:`kvdiag.events`
and :mod:`kvdiag.paths`.
"""
