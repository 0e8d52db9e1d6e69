"""vLLM plugin (entry point group ``vllm.general_plugins``): registers FCA as vLLM's CUSTOM
attention backend. vLLM calls it in every process it starts, so it must stay cheap and idempotent:
it only records a class path; nothing of the backend is imported until vLLM selects it
(``attention_config={"backend": "CUSTOM"}``, which the ``vllm`` sampler sets with ``fca: true``)."""

from __future__ import annotations

BACKEND = "arctic_fca.vllm_attention.FCAAttentionBackend"


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
