"""A candidate kernel for a decode step's matrix products, measured against cuBLAS by
``decode_gemm.py``: ``x @ W.T (+ b)`` for ``x [M <= 128, K]``, one program per ``BLOCK_N`` output
columns for all rows and a slice of K (split-K; the last program of a column tile to arrive sums
the partials in a fixed order and resets its arrival counter, so a product stays one launch), and
a gated form that computes a tile's gate and up columns together and writes ``silu(gate) * up``
rounded as the unfused path rounds. ``pdl``: programmatic dependent launch (Hopper and later): the
kernel may start while the one before it finishes and waits for it before reading ``x``; ``early``
loads the first weight block before that wait (weights do not depend on the kernel before).

On the H200 it matches cuBLAS within a few percent at Qwen3-1.7B's products and does not beat it,
so the engine keeps cuBLAS; the figures are in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from arctic_fca.engine.triton_ops import silu_times_up
from arctic_fca.fca.triton_decode import launch_fitting_stages
from arctic_fca.fca.work import device_sms

MAX_ROWS = 128  # decode batches; beyond, cuBLAS tiles fill the GPU on their own
_COUNTERS = 1 << 14  # column tiles a split launch may have
_counters: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class LinearConfig:
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def choose_config(rows: int, n: int, k: int, sms: int, gated: bool = False) -> LinearConfig:
    """Tiles for ``rows`` rows, ``n`` output columns (per gated half) and depth ``k`` (measured on
    the H200 at Qwen3-1.7B's products, ``bench/decode_gemm.py --sweep``): narrow column tiles, K
    split only while the launch has under one program per SM and each keeps >= 2048 of depth."""
    block_n, block_k = (64, 128) if gated else (32, 256)
    if rows > 64:
        block_k = 128  # the taller x tile's stages must still fit in shared memory
    tiles, split = triton.cdiv(n, block_n), 1
    while tiles * split * 2 <= sms and k // (split * 2) >= 2048:
        split *= 2
    return LinearConfig(block_n=block_n, block_k=block_k, split_k=split)


@triton.jit
def _dot(x, w, IEEE: tl.constexpr):
    """``x @ w.T`` in fp32 (IEEE: full fp32 products, no TF32)."""
    if IEEE:
        return tl.dot(x, tl.trans(w), input_precision="ieee")
    return tl.dot(x, tl.trans(w))


@triton.jit
def _weight_block(w_ptr, cols, k, N, K, stride_wn, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """Columns ``cols`` x depth ``k:k + BLOCK_K`` of the weight (GATED: and of its up half)."""
    ks = k + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None] * stride_wn + ks[None, :]
    w_ok = (cols < N)[:, None] & (ks < K)[None, :]
    w = tl.load(w_rows, mask=w_ok, other=0.0)
    if GATED:
        return w, tl.load(w_rows + N * stride_wn, mask=w_ok, other=0.0)
    return w, w


@triton.jit
def _x_block(x_ptr, rows, k, M, K, stride_xm, BLOCK_K: tl.constexpr):
    ks = k + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows < M)[:, None] & (ks < K)[None, :],
                   other=0.0)


@triton.jit
def _partial_products(x_ptr, w_ptr, acc, up, rows, cols, k_begin, k_end, M, N, K, stride_xm, stride_wn,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr):
    """``acc + x[rows, k_begin:k_end] @ W[cols, k_begin:k_end].T`` in fp32, and with GATED the same
    for the up rows ``N + cols`` into ``up`` in the same loop."""
    for k in range(k_begin, k_end, BLOCK_K):
        x = _x_block(x_ptr, rows, k, M, K, stride_xm, BLOCK_K)
        w, u = _weight_block(w_ptr, cols, k, N, K, stride_wn, BLOCK_K, GATED)
        acc += _dot(x, w, IEEE)
        if GATED:
            up += _dot(x, u, IEEE)
    return acc, up


@triton.jit
def _epilogue(acc, up, b_ptr, out_ptr, rows, cols, M, N, stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GATED:  # each product rounded to the model's dtype, as the unfused path stores them
        acc = silu_times_up(acc.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(dtype), mask=mask)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
                          stride_om, k_per_split,
                          HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                          EARLY: tl.constexpr):
    # Program (column tile, K slice). GATED: weight rows [0, N) are the gate, [N, 2N) the up.
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if EARLY:  # the first weight block does not depend on the kernel before: load it before waiting
        w0, u0 = _weight_block(w_ptr, cols, k_begin, N, K, stride_wn, BLOCK_K, GATED)
    if PDL:  # launched while the kernel before still runs: let the next launch, wait for x
        gdc_launch_dependents()
        gdc_wait()
    if EARLY:
        x0 = _x_block(x_ptr, rows, k_begin, M, K, stride_xm, BLOCK_K)
        acc += _dot(x0, w0, IEEE)
        if GATED:
            up += _dot(x0, u0, IEEE)
        k_begin += BLOCK_K
    acc, up = _partial_products(x_ptr, w_ptr, acc, up, rows, cols, k_begin, k_end, M, N, K, stride_xm, stride_wn,
                                BLOCK_K, IEEE, GATED)
    if SPLIT_K == 1:
        _epilogue(acc, up, b_ptr, out_ptr, rows, cols, M, N, stride_om, HAS_BIAS, GATED)
    else:
        # Partials [SPLIT_K, 1 + GATED, BLOCK_M, N] (fp32); the tile's last arrival sums them.
        halves: tl.constexpr = 2 if GATED else 1
        offsets = rows[:, None] * N + cols[None, :]
        col_ok = (cols < N)[None, :]
        own = part_ptr + split * halves * BLOCK_M * N
        tl.store(own + offsets, acc, mask=col_ok)
        if GATED:
            tl.store(own + BLOCK_M * N + offsets, up, mask=col_ok)
        arrived = tl.atomic_add(count_ptr + tile, 1)  # release: the partials above are visible first
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(part_ptr + s * halves * BLOCK_M * N + offsets, mask=col_ok, other=0.0,
                               cache_modifier=".cg")
                if GATED:
                    up += tl.load(part_ptr + (s * halves + 1) * BLOCK_M * N + offsets, mask=col_ok, other=0.0,
                                  cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch (CUDA graph replays included)
            _epilogue(acc, up, b_ptr, out_ptr, rows, cols, M, N, stride_om, HAS_BIAS, GATED)


def _arrival_counters(device: torch.device) -> torch.Tensor:
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear ran first inside a CUDA graph capture: warm it up before capturing")
        counters = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counters


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False,
                  config: LinearConfig | None = None, pdl: bool = False, early: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M <= MAX_ROWS, K]`` (``weight [N, K]``, rows contiguous);
    ``gated``: ``weight`` stacks gate over up (``[2 I, K]``) and the result is ``silu(gate) * up``
    ``[M, I]``, as ``silu_and_mul(F.linear(x, weight))``."""
    rows, depth = x.shape
    if rows > MAX_ROWS or weight.shape[1] != depth or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear takes x [<= {MAX_ROWS}, K] and weight [N, K] with contiguous rows; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = x.new_empty(rows, n)
    if rows == 0:
        return out
    config = config or choose_config(rows, n, depth, device_sms(x.device), gated)
    block_m = max(16, triton.next_power_of_2(rows))
    tiles = triton.cdiv(n, config.block_n)
    k_per_split = triton.cdiv(triton.cdiv(depth, config.block_k), config.split_k) * config.block_k
    split = triton.cdiv(depth, k_per_split)
    partials = x.new_empty(split * (2 if gated else 1) * block_m * n, dtype=torch.float32) if split > 1 else out
    counters = _arrival_counters(x.device)
    if tiles > counters.numel():
        raise ValueError(f"skinny_linear: {tiles} column tiles exceed the {counters.numel()} arrival counters")
    launch_fitting_stages((x.device, x.dtype, block_m, gated, config), config.num_stages,
                          lambda stages: _skinny_linear_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, out, partials, counters, rows, n, depth, x.stride(0),
        weight.stride(0), out.stride(0), k_per_split,
        HAS_BIAS=bias is not None, GATED=gated, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, IEEE=x.dtype == torch.float32, PDL=pdl, EARLY=early,
        num_warps=config.num_warps, num_stages=stages, launch_pdl=pdl))
    return out
