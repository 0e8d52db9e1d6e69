"""Arctic sampling backends (the reference transformers sampler; FCA kernels and engines next)."""

from arctic_core._old_paths import register_moved_modules

MOVED = {
    # 0.2.0: the vLLM backend's modules grouped into arctic_fca.vllm (without their vllm_ prefix).
    **{f"arctic_fca.vllm_{name}": f"arctic_fca.vllm.{name}"
       for name in ("attention", "fca", "host_tables", "plugin", "sampler", "worker")},
}
"""Old module path -> its current one; the old paths import with a DeprecationWarning (kept at least
through arctic-fca 0.3)."""

register_moved_modules(MOVED)
