"""The decoder's small per-layer operations, each one kernel on CUDA: residual add + RMSNorm, the
per-head query/key norm + rotary embedding + KV-cache store, and SiLU(gate) x up.

A transformers decoder layer runs these as dozens of tiny elementwise kernels; at decode batch
sizes their launches cost more than the matrix products. The torch versions below are the
reference: they round exactly where transformers' modules round (fp32 statistics, results in the
model's dtype), so in fp32 the decoder reproduces transformers bit for bit. The Triton kernels
(``triton_ops``, used on CUDA or under ``TRITON_INTERPRET=1``) round at the same points.
"""

from __future__ import annotations

import torch

from arctic_fca.engine.kv_cache import PagedKVCache


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; the sum is the next residual (``x`` when None)."""
    if triton:
        from arctic_fca.engine.triton_ops import add_rms_norm as kernel

        return kernel(x, residual, weight, eps)
    summed = x if residual is None else residual + x
    return rms_norm(summed, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in fp32, normalised value rounded to the input's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding (``x * cos + rotate_half(x) * sin``) of ``x [T, heads, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def qk_rope_store(qkv: torch.Tensor, heads: tuple[int, int, int], positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                  cache: PagedKVCache, layer: int, slots: torch.Tensor, *, triton: bool,
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection ``qkv [T, (Hq + 2 Hkv) D]`` into heads, norm each query/key head
    (when the model has such norms), rotate both by ``positions`` (tables ``cos/sin [max_len, D]``),
    and store the keys and values in the paged cache at ``slots``. Returns ``q [T, Hq, D]``,
    ``k, v [T, Hkv, D]``."""
    if triton:
        from arctic_fca.engine.triton_ops import qk_rope_store as kernel

        return kernel(qkv, heads, positions, cos, sin, q_norm, k_norm, eps, cache, layer, slots, pdl)
    num_q, num_kv, dim = heads
    q, k, v = qkv.view(qkv.shape[0], num_q + 2 * num_kv, dim).split((num_q, num_kv, num_kv), dim=1)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos, sin = cos[positions], sin[positions]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    cache.write(layer, slots, k, v)
    return q, k, v


def silu_and_mul(gate_up: torch.Tensor, *, triton: bool) -> torch.Tensor:
    """``silu(gate) * up`` of the fused ``[T, 2 I]`` projection (gate first)."""
    if triton:
        from arctic_fca.engine.triton_ops import silu_and_mul as kernel

        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
