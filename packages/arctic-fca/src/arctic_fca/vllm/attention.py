"""FCA as a vLLM 0.24 attention backend (imported by vLLM only; registered by ``plugin``).

The backend is one of vLLM's own backends with one path added: decode rows (one query token
each; a batch of them, or the leading rows of a mixed batch) run FCA. Everything else stays the
base backend's, unchanged: the KV-cache layout ``[num_blocks, 2, block_size, kv_heads, head_dim]``
and its writes, prefill rows, and the layers FCA cannot run exactly (sliding window, ALiBi,
soft-capped logits, sinks, encoder or cross attention, quantized KV or outputs). Two bases, both
with that layout:

- ``FCAAttentionBackend`` over FlashAttention (the default; bf16 / fp16);
- ``FCATritonAttentionBackend`` over vLLM's Triton backend, which also runs fp32 (used to check
  greedy outputs against vLLM without bf16 rounding in the way).

The mixins live in ``arctic_fca.vllm.fca`` (tested on the CPU without vLLM). Per step the
metadata builder calls :class:`arctic_fca.fca.device_work.DeviceWorkBuilder` on the
step's device block table and sequence lengths: the shared-prefix forest, the cost model's choice
(FCA or the plain split-K pass of the same Triton kernel) and the work items are all tensors
written into persistent buffers, so there is no device-to-host sync and a full CUDA graph of a
decode step replays the kernels unchanged (the builder keeps its base's CUDA-graph support level up to
UNIFORM_BATCH: a batch of prefill and decode runs piecewise, since its split is decided on the host).
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

from arctic_fca.vllm.fca import FCABuilderMixin, FCAImplMixin


def _subclass(name: str, bases: tuple[type, ...], body: dict | None = None) -> type:
    """A module-level class (importable by name, so pickling and vLLM's class paths work)."""
    cls = type(name, bases, {"__module__": __name__, "__qualname__": name, **(body or {})})
    globals()[name] = cls
    return cls


def fca_backend(base: type[AttentionBackend]) -> type[AttentionBackend]:
    """``base`` with FCA decode: its builder and impl get the ``arctic_fca.vllm.fca`` mixins."""
    builder = _subclass(f"FCA{base.get_builder_cls().__name__}", (FCABuilderMixin, base.get_builder_cls()))
    impl = _subclass(f"FCA{base.get_impl_cls().__name__}", (FCAImplMixin, base.get_impl_cls()))
    return _subclass(f"FCA{base.__name__}", (base,), {
        # vLLM looks a backend up by this name in AttentionBackendEnum: ours is the CUSTOM slot.
        "get_name": staticmethod(lambda: "CUSTOM"),
        "get_impl_cls": staticmethod(lambda: impl),
        "get_builder_cls": staticmethod(lambda: builder),
    })


FCAAttentionBackend = fca_backend(FlashAttentionBackend)  # FCAFlashAttentionBackend
FCATritonAttentionBackend = fca_backend(TritonAttentionBackend)
