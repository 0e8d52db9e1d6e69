"""Arctic sampling backends (the reference transformers sampler; FCA kernels and engines next)."""
