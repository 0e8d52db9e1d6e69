"""vLLM plugin (entry point group ``vllm.general_plugins``): registers FCA as vLLM's CUSTOM
attention backend. vLLM calls it in every process it starts, so it must stay cheap and idempotent:
it only records a class path; nothing of the backend is imported until vLLM selects it
(``attention_config={"backend": "CUSTOM"}``, which the ``vllm`` sampler sets with ``fca: true``).

The vLLM backend FCA extends is read from ``ARCTIC_FCA_VLLM_BASE`` (inherited by vLLM's worker
processes): ``FLASH_ATTN`` (default) or ``TRITON_ATTN`` (which also runs fp32)."""

from __future__ import annotations

import os

BASE_ENV = "ARCTIC_FCA_VLLM_BASE"
BACKENDS = {
    "FLASH_ATTN": "arctic_fca.vllm.attention.FCAAttentionBackend",
    "TRITON_ATTN": "arctic_fca.vllm.attention.FCATritonAttentionBackend",
}


def register() -> None:
    base = os.environ.get(BASE_ENV, "FLASH_ATTN")
    if base not in BACKENDS:
        raise ValueError(f"{BASE_ENV}={base!r}: FCA extends one of {sorted(BACKENDS)}")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKENDS[base])
