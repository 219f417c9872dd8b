"""Reference kernels (torch references, Triton on CUDA) run in shadow mode on copies of live KV."""
