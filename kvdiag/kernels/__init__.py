"""Reference kernels, the tensor maths of the shadow measurements: quantization (torch
references, fused CPU code, Triton on CUDA), sparse coding, differential block coding (its
writer keeps the reference blocks) and attention probabilities (with the capture of a decode
step's queries), on tensors handed in, never the live ones.

May import :mod:`kvdiag.events` (schema types), :mod:`kvdiag.pool` and :mod:`kvdiag.paths`.
"""
