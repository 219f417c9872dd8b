"""Reference kernels (pure tensor maths: hashing, quantization, sparse coding, attention
probabilities; torch references, Triton on CUDA) run in shadow mode on copies of live KV."""
