"""Triton kernels of ``fused_ops``: one program per token row (and head), statistics in fp32, results
rounded to the model's dtype at the same points as transformers' modules."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from arctic_fca.engine.kv_cache import PagedKVCache


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n, eps, HAS_RESIDUAL: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = (x + tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(sum_ptr + row * n + cols, x.to(dtype), mask=mask)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    rows, n = x.shape
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual.contiguous(), weight, out, summed, n, eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out, summed


@triton.jit
def _head_norm(x1, x2, w_ptr, eps, HALF: tl.constexpr):
    """RMSNorm of one head given as its two halves (fp32 in, the model's dtype rounding applied)."""
    dtype = w_ptr.dtype.element_ty
    offs = tl.arange(0, HALF)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + offs).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
    y1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _qk_rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, slot_ptr, q_out_ptr, k_out_ptr,
                          k_cache_ptr, v_cache_ptr, eps, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
                          HALF: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    """Program (token, head): heads below NUM_Q are queries, the rest keys, whose program also moves
    the matching value head into the cache. PDL: launched as a programmatic dependent of the
    product before it, so wait for that product's output first."""
    if PDL:
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dim: tl.constexpr = 2 * HALF
    dtype = q_out_ptr.dtype.element_ty
    offs = tl.arange(0, HALF)
    src = qkv_ptr + token * (NUM_Q + 2 * NUM_KV) * dim + head * dim
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    if HAS_NORM:
        if head < NUM_Q:
            x1, x2 = _head_norm(x1, x2, qn_ptr, eps, HALF)
        else:
            x1, x2 = _head_norm(x1, x2, kn_ptr, eps, HALF)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    c1 = tl.load(cos_ptr + pos * dim + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * dim + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * dim + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * dim + HALF + offs).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as transformers' bf16 ops are.
    o1 = ((x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
    if head < NUM_Q:
        dst = q_out_ptr + (token * NUM_Q + head) * dim
        tl.store(dst + offs, o1)
        tl.store(dst + HALF + offs, o2)
    else:
        kv_head = head - NUM_Q
        k_dst = k_out_ptr + (token * NUM_KV + kv_head) * dim
        tl.store(k_dst + offs, o1)
        tl.store(k_dst + HALF + offs, o2)
        cache_row = (tl.load(slot_ptr + token).to(tl.int64) * NUM_KV + kv_head) * dim
        tl.store(k_cache_ptr + cache_row + offs, o1)
        tl.store(k_cache_ptr + cache_row + HALF + offs, o2)
        v_src = src + NUM_KV * dim
        tl.store(v_cache_ptr + cache_row + offs, tl.load(v_src + offs))
        tl.store(v_cache_ptr + cache_row + HALF + offs, tl.load(v_src + HALF + offs))


def qk_rope_store(qkv: torch.Tensor, heads: tuple[int, int, int], positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                  cache: PagedKVCache, layer: int, slots: torch.Tensor, pdl: bool = False):
    num_q, num_kv, dim = heads
    qkv = qkv.contiguous()
    tokens = qkv.shape[0]
    q = qkv.new_empty(tokens, num_q, dim)
    k = qkv.new_empty(tokens, num_kv, dim)
    # One warp per (token, head): a program's two half-heads are a few dozen values each; one warp
    # was faster than four at every token count measured (docs/design/fca.md).
    _qk_rope_store_kernel[(tokens, num_q + num_kv)](
        qkv, positions, cos, sin, q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos, slots,
        q, k, cache.keys[layer], cache.values[layer], eps, NUM_Q=num_q, NUM_KV=num_kv, HALF=dim // 2,
        HAS_NORM=q_norm is not None, PDL=pdl, num_warps=1, **({"launch_pdl": True} if pdl else {}))
    v = qkv.view(tokens, num_q + 2 * num_kv, dim)[:, num_q + num_kv:]
    return q, k, v


@triton.jit
def silu_times_up(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` of fp32 values, rounded as transformers rounds in ``dtype``: the activation
    rounded first, then the product (returned in fp32, for the caller to round)."""
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return activated * up


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, silu_times_up(gate, up, dtype).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, n)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out
