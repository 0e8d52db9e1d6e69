"""A decode step's matrix products for a few rows, with the small operations around them folded in.

At decode batch sizes (a few dozen rows) a product is a stream over its weight, and every kernel
between two products (the residual add + RMSNorm, SiLU x up) costs a launch, a ramp-up and a tail
of its own. ``fused_linear`` computes ``x @ W.T`` with one program per ``BLOCK_N`` output columns
for all rows and a slice of the depth (split-K: the last program of a column tile to arrive sums
the partials in a fixed order and resets its arrival counter, so a product stays one launch), and
folds in:

- ``residual``: ``residual + x @ W.T``, the product rounded to the model's dtype first, as
  transformers adds its layers' outputs to the residual stream.
- RMSNorm, split between the product that writes the residual stream and the one that reads it:
  ``norm(h) @ W.T = r * ((h * g) @ W.T)`` with ``r`` each row's ``rsqrt(mean(h^2) + eps)``. The
  writer (``next_norm=g``) also stores ``h * g`` and its tiles' sums of ``h^2`` (:class:`Normed`);
  the reader multiplies with ``h * g`` as it is and scales its outputs by ``r`` at the end. No norm
  kernel, and the products' inner loops stay plain streams (normalising ``x`` inside the reader's
  loop took its registers and doubled the products' time).
- ``gated``: ``W`` stacks gate over up; a program computes a tile's gate and up columns together
  and writes ``silu(gate) * up``, rounded as the unfused path rounds.

In fp32 the results equal the unfused path's up to the order of the sums; in bf16 the normalised
input is rounded once (``h * g``) where transformers rounds it twice (``h * r``, then ``* g``), so
greedy tokens may part at near-ties only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from arctic_fca.engine.triton_ops import silu_times_up
from arctic_fca.fca.triton_decode import launch_fitting_stages
from arctic_fca.fca.work import device_sms

# Rows up to which the decoder runs its products here. At Qwen3-1.7B's shapes the kernel matches
# cuBLAS up to 64 rows and falls behind it above, where cuBLAS's tiles fill the GPU on their own
# (docs/design/fca.md).
MAX_ROWS = 64
_COUNTERS = 1 << 14  # column tiles a split launch may have
# Split launches' arrival counters, one set per device: its products run one after another (one
# stream), each leaving the counters at zero for the next.
_counters: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class Normed:
    """Rows ``h`` ready for an RMSNorm folded into the product that reads them: ``scaled = h * g``
    in ``h``'s dtype, and ``squares [tiles, M]`` (fp32), partial sums of ``h^2`` whose sum over
    tiles is each row's."""

    scaled: torch.Tensor
    squares: torch.Tensor

    @classmethod
    def of(cls, h: torch.Tensor, g: torch.Tensor, *, triton: bool = False) -> Normed:
        """``h`` prepared where no product wrote it (e.g. the embeddings); ``triton``: in one kernel
        rather than a handful of torch ops."""
        if triton:
            return cls(*_scaled_rows(h, g))
        h32 = h.float()
        return cls((h32 * g.float()).to(h.dtype), h32.square().sum(-1)[None])

    def normalized(self, eps: float, *, triton: bool = False) -> torch.Tensor:
        """``rms_norm(h, g, eps)`` itself (the final norm, which no product reads); ``triton``: in
        one kernel."""
        if triton:
            return _normalized_rows(self.scaled, self.squares, eps)
        r = torch.rsqrt(self.squares.sum(0) / self.scaled.shape[-1] + eps)
        return (self.scaled.float() * r[:, None]).to(self.scaled.dtype)


def _scaled_rows(h: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = h.shape
    scaled, squares = torch.empty_like(h), h.new_empty(1, rows, dtype=torch.float32)
    _scale_rows_kernel[(rows,)](h.contiguous(), g, scaled, squares, n, BLOCK=triton.next_power_of_2(n))
    return scaled, squares


def _normalized_rows(scaled: torch.Tensor, squares: torch.Tensor, eps: float) -> torch.Tensor:
    (tiles, rows), n = squares.shape, scaled.shape[1]
    out = torch.empty_like(scaled)
    _normalize_rows_kernel[(rows,)](scaled, squares, out, rows, n, tiles, eps,
                                    TILES_BLOCK=triton.next_power_of_2(tiles), BLOCK=triton.next_power_of_2(n))
    return out


@triton.jit
def _scale_rows_kernel(h_ptr, g_ptr, scaled_ptr, squares_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(h_ptr + row * n + cols, mask=mask, other=0.0)
    h32 = h.to(tl.float32)
    g = tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(scaled_ptr + row * n + cols, (h32 * g).to(h.dtype), mask=mask)
    tl.store(squares_ptr + row, tl.sum(h32 * h32, 0))


@triton.jit
def _normalize_rows_kernel(scaled_ptr, squares_ptr, out_ptr, M, n, tiles, eps, TILES_BLOCK: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0)
    r = _row_scale(squares_ptr, tiles, row + tl.arange(0, 1), M, n, eps, TILES_BLOCK)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    offsets = row.to(tl.int64) * n + cols
    x = tl.load(scaled_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, (x.to(tl.float32) * r).to(x.dtype), mask=mask)


def row_tile(rows: int) -> int:
    """The rows a program computes: 16 up to 16 rows, else 64 (a 32-row tile made the products
    slower than the 64-row one, whose padding rows are masked off: docs/design/fca.md)."""
    return 16 if rows <= 16 else 64


def dependent_launch_pays(rows: int) -> bool:
    """Whether programmatic dependent launch shortens a chain of these products (a layer's
    products at Qwen3-1.7B's shapes, docs/design/fca.md): with 64-row tiles yes; with 16-row tiles
    two programs fit per SM, and the waiting launch's programs take the running one's places, which
    makes the chain slower."""
    return row_tile(rows) == 64


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
def _weight_block(w_ptr, cols, ks, N, K, stride_wn, GATED: tl.constexpr):
    """Columns ``cols`` x depth ``ks`` of the weight (GATED: and of its up half)."""
    w_rows = w_ptr + cols[:, None] * stride_wn + ks[None, :]
    w_ok = (cols < N)[:, None] & (ks < K)[None, :]
    w = tl.load(w_rows, mask=w_ok, other=0.0)
    if GATED:
        return w, tl.load(w_rows + N * stride_wn, mask=w_ok, other=0.0)
    return w, w


@triton.jit
def _partial_products(x_ptr, w_ptr, acc, up, rows, cols, k_begin, k_end, M, N, K, stride_xm, stride_wn,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr):
    """``acc + x[rows, k_begin:k_end] @ W[cols, k_begin:k_end].T`` in fp32, and with GATED the same
    for the up rows ``N + cols`` into ``up`` in the same loop."""
    for k in range(k_begin, k_end, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows < M)[:, None] & (ks < K)[None, :],
                    other=0.0)
        w, u = _weight_block(w_ptr, cols, ks, N, K, stride_wn, GATED)
        acc += _dot(x, w, IEEE)
        if GATED:
            up += _dot(x, u, IEEE)
    return acc, up


@triton.jit
def _row_scale(squares_ptr, squares_tiles, rows, M, K, eps, TILES_BLOCK: tl.constexpr):
    """Each row's ``rsqrt(mean(h^2) + eps)`` from the writer's partial sums ``[tiles, M]``, read in
    one load (a loop of dependent loads would wait on L2 once per tile)."""
    tiles = tl.arange(0, TILES_BLOCK)
    partial = tl.load(squares_ptr + tiles[:, None] * M + rows[None, :],
                      mask=(tiles < squares_tiles)[:, None] & (rows < M)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(partial, axis=0) / K + eps)


@triton.jit
def _epilogue(acc, up, b_ptr, res_ptr, out_ptr, squares_ptr, squares_tiles, g_ptr, scaled_ptr, squares_out_ptr, tile,
              rows, cols, M, N, K, eps, stride_om, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
              TILES_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, NEXT_NORM: tl.constexpr, GATED: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if NORM:
        scale = _row_scale(squares_ptr, squares_tiles, rows, M, K, eps, TILES_BLOCK)[:, None]
        acc *= scale
        up *= scale
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GATED:  # each product rounded to the model's dtype, as the unfused path stores them
        acc = silu_times_up(acc.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    offsets = rows[:, None] * stride_om + cols[None, :]
    if RESIDUAL:
        acc = acc.to(dtype).to(tl.float32) + tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = acc.to(dtype)
    tl.store(out_ptr + offsets, out, mask=mask)
    if NEXT_NORM:  # what the next product needs to normalise these rows on its way
        h = tl.where(mask, out.to(tl.float32), 0.0)
        g = tl.load(g_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(scaled_ptr + offsets, (h * g[None, :]).to(dtype), mask=mask)
        tl.store(squares_out_ptr + tile * M + rows, tl.sum(h * h, axis=1), mask=rows < M)


# The row count varies from step to step (sequences finish, graphs per batch size): one compiled
# kernel per row tile, not one per row count's divisibility.
@triton.jit(do_not_specialize=["M"])
def _fused_linear_kernel(x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, part_ptr, count_ptr, squares_ptr, squares_tiles, g_ptr,
                         scaled_ptr, squares_out_ptr, M, N, K, stride_xm, stride_wn, stride_om, k_per_split, eps,
                         HAS_BIAS: tl.constexpr, NORM: tl.constexpr, TILES_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
                         NEXT_NORM: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    # Program (column tile, K slice). GATED: weight rows [0, N) are the gate, [N, 2N) the up.
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PDL:  # launched while the kernel before still runs: let the next launch start, wait for x
        gdc_launch_dependents()
        gdc_wait()
    acc, up = _partial_products(x_ptr, w_ptr, acc, up, rows, cols, k_begin, k_end, M, N, K, stride_xm, stride_wn,
                                BLOCK_K, IEEE, GATED)
    if SPLIT_K == 1:
        _epilogue(acc, up, b_ptr, res_ptr, out_ptr, squares_ptr, squares_tiles, g_ptr, scaled_ptr, squares_out_ptr,
                  tile, rows, cols, M, N, K, eps, stride_om, HAS_BIAS, NORM, TILES_BLOCK, RESIDUAL, NEXT_NORM, GATED)
    else:
        # Partials [SPLIT_K, 1 + GATED, BLOCK_M, N] (fp32); the tile's last arrival adds them up.
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
            _epilogue(acc, up, b_ptr, res_ptr, out_ptr, squares_ptr, squares_tiles, g_ptr, scaled_ptr,
                      squares_out_ptr, tile, rows, cols, M, N, K, eps, stride_om, HAS_BIAS, NORM, TILES_BLOCK, RESIDUAL,
                      NEXT_NORM, GATED)


def _arrival_counters(device: torch.device) -> torch.Tensor:
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_linear ran first inside a CUDA graph capture: warm it up before capturing")
        counters = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counters


def _check(x: torch.Tensor, weight: torch.Tensor, bias, residual, next_norm, gated: bool) -> int:
    """Output columns of the product; a clear error for inputs the kernel does not take."""
    rows, depth = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if rows > MAX_ROWS or weight.shape[1] != depth or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fused_linear takes x [<= {MAX_ROWS}, K] and weight [N, K] with contiguous rows; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if gated and (bias is not None or weight.shape[0] % 2):
        raise ValueError("fused_linear(gated=True) takes a bias-free weight stacking gate over up ([2 I, K])")
    if next_norm is not None and (residual is None or tuple(next_norm.shape) != (n,)):
        raise ValueError(f"fused_linear: next_norm {tuple(next_norm.shape)} needs a residual and {n} columns")
    if residual is not None and (tuple(residual.shape) != (rows, n) or not residual.is_contiguous()):
        raise ValueError(f"fused_linear: residual {tuple(residual.shape)} for output {(rows, n)} (contiguous)")
    return n


@overload
def fused_linear(x: torch.Tensor | Normed, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 eps: float = 0.0, residual: torch.Tensor | None = None, next_norm: None = None, gated: bool = False,
                 pdl: bool = False, config: LinearConfig | None = None) -> torch.Tensor: ...


@overload
def fused_linear(x: torch.Tensor | Normed, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 eps: float = 0.0, residual: torch.Tensor, next_norm: torch.Tensor, gated: bool = False,
                 pdl: bool = False, config: LinearConfig | None = None) -> tuple[torch.Tensor, Normed]: ...


def fused_linear(x, weight, bias=None, *, eps=0.0, residual=None, next_norm=None, gated=False, pdl=False,
                 config=None):
    """``F.linear(x, weight, bias)`` for ``x [M <= MAX_ROWS, K]`` (``weight [N, K]``, rows
    contiguous); with ``x`` given as :class:`Normed` rows ``h``, the product of ``rms_norm(h, g,
    eps)``. ``residual [M, N]``: added to the result. ``next_norm`` (with a residual): also the result prepared for the
    next product's norm with that weight, returned as ``(result, Normed)``. ``gated``: ``weight``
    stacks gate over up (``[2 I, K]``) and the result is ``silu(gate) * up [M, I]``. ``pdl``:
    programmatic dependent launch (Hopper and later), the kernel starting while the one before it
    ends and waiting for it before it reads ``x``."""
    normed = x if isinstance(x, Normed) else None
    x = normed.scaled if normed is not None else x
    n = _check(x, weight, bias, residual, next_norm, gated)
    rows, depth = x.shape
    out = x.new_empty(rows, n)
    config = config or choose_config(rows, n, depth, device_sms(x.device), gated)
    tiles = triton.cdiv(n, config.block_n)
    prepared = None
    if next_norm is not None:
        prepared = Normed(torch.empty_like(out), out.new_empty(tiles, rows, dtype=torch.float32))
    if rows:
        _launch(x, weight, bias, normed, residual, next_norm, prepared, out, eps, gated, pdl, config, tiles)
    return out if prepared is None else (out, prepared)


def _launch(x, weight, bias, normed, residual, next_norm, prepared, out, eps, gated, pdl, config, tiles) -> None:
    rows, depth = x.shape
    n = out.shape[1]
    block_m = row_tile(rows)
    k_per_split = triton.cdiv(triton.cdiv(depth, config.block_k), config.split_k) * config.block_k
    split = triton.cdiv(depth, k_per_split)
    partials = x.new_empty(split * (2 if gated else 1) * block_m * n, dtype=torch.float32) if split > 1 else out
    counters = _arrival_counters(x.device)
    if tiles > counters.numel():
        raise ValueError(f"fused_linear: {tiles} column tiles exceed the {counters.numel()} arrival counters")
    unused = weight  # a pointer for the arguments a launch does not read
    squares, squares_tiles = (normed.squares, normed.squares.shape[0]) if normed is not None else (partials, 0)
    scaled, squares_out = (prepared.scaled, prepared.squares) if prepared is not None else (out, partials)
    launch = {"launch_pdl": True} if pdl else {}
    launch_fitting_stages((x.device, x.dtype, block_m, gated, config), config.num_stages,
                          lambda stages: _fused_linear_kernel[(tiles, split)](
        x, weight, unused if bias is None else bias, unused if residual is None else residual, out, partials, counters,
        squares, squares_tiles, unused if next_norm is None else next_norm, scaled, squares_out, rows, n, depth,
        x.stride(0), weight.stride(0), out.stride(0), k_per_split, eps,
        HAS_BIAS=bias is not None, NORM=normed is not None, TILES_BLOCK=triton.next_power_of_2(max(1, squares_tiles)),
        RESIDUAL=residual is not None,
        NEXT_NORM=next_norm is not None, GATED=gated, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, IEEE=x.dtype == torch.float32, PDL=pdl, num_warps=config.num_warps,
        num_stages=stages, **launch))
