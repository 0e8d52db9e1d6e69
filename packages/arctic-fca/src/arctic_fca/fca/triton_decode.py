"""Triton kernels for paged decode attention: FCA and the plain FlashDecoding-style baseline.

Two kernels serve both (``arctic_fca.fca.work`` builds their work items, on the host or the device):

- ``_partial_attention``: one program per (work item, KV head). It loads the query heads of that
  KV head for every request the item serves (a tile of ``requests x group`` rows), streams the
  item's KV tokens through the block table ``BLOCK_N`` tokens at a time (each a gather of
  ``BLOCK_N / block_size`` pages) with an online softmax, and writes one fp32 partial (out, lse)
  per request -- or, when every request is a single unsplit item, the final output directly.
- ``_merge_partials``: one program per (request, head); combines its partial rows with
  log-sum-exp weights.

FCA launches the partial kernel twice (shared-node items with tall query tiles, and the
one-request suffix items, side by side on two CUDA streams) and merges; plain decode is the same
kernel over whole sequences, so the comparison is between two uses of one kernel of the same
quality.

Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU (slowly), which is how the CPU test
suite checks them against the exact torch path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from arctic_fca.fca.work import DeviceLaunch, DeviceWork, device_sms

LOG2E = 1.4426950408889634
# Streams for the node launch, which runs beside the single launch (two branches of a captured
# CUDA graph) when the work's tuning says so.
_side_streams: dict[torch.device, torch.cuda.Stream] = {}
# Pipeline stages that fit each (device, tile) where the configured ones do not: a GPU with less
# shared memory per block than the H200's 227 KiB (an A100's 163 KiB) gets fewer, not an error.
_fitted_stages: dict[tuple, int] = {}


@triton.jit
def _partial_attention(
    q_ptr, k_ptr, v_ptr, kv_index_ptr, q_index_ptr, items_ptr, count_ptr,
    out_ptr, lse_ptr,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_or, stride_oh, stride_lr, stride_items,
    scale_log2,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
):
    kv_head = tl.program_id(1)
    # Persistent over items: a fixed grid (a CUDA graph replays the same one every step) strides
    # over this step's items, however many there are.
    for item in range(tl.program_id(0), tl.load(count_ptr), tl.num_programs(0)):
        _attend_item(q_ptr, k_ptr, v_ptr, kv_index_ptr, q_index_ptr, items_ptr, out_ptr, lse_ptr, item, kv_head,
                     stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     stride_or, stride_oh, stride_lr, stride_items, scale_log2,
                     GROUP, PAGE, HEAD_DIM, DIM_P2, BLOCK_Q, BLOCK_N, DIRECT, IEEE)


@triton.jit
def _attend_item(q_ptr, k_ptr, v_ptr, kv_index_ptr, q_index_ptr, items_ptr, out_ptr, lse_ptr, item, kv_head,
                 stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_or, stride_oh, stride_lr, stride_items, scale_log2,
                 GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr):
    kv_start = tl.load(items_ptr + item)
    kv_len = tl.load(items_ptr + stride_items + item)
    q_start = tl.load(items_ptr + 2 * stride_items + item)
    q_count = tl.load(items_ptr + 3 * stride_items + item)
    out_row = tl.load(items_ptr + 4 * stride_items + item)

    request, head, local, row_ok = _query_rows(q_index_ptr, q_start, q_count, kv_head, GROUP, BLOCK_Q)
    q = _query_tile(q_ptr, request, head, row_ok, stride_qr, stride_qh, HEAD_DIM, DIM_P2)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, DIM_P2], tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        m, row_sum, acc = _attend_block(q, k_ptr, v_ptr, kv_index_ptr, kv_start, kv_len, start, kv_head,
                                        m, row_sum, acc,
                                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
                                        PAGE, HEAD_DIM, DIM_P2, BLOCK_N, IEEE)
    _write_result(out_ptr, lse_ptr, acc, m, row_sum, request, head, local, row_ok, out_row,
                  stride_or, stride_oh, stride_lr, HEAD_DIM, DIM_P2, DIRECT)


@triton.jit
def _query_rows(q_index_ptr, q_start, q_count, kv_head, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The rows of an item's query tile: the GROUP heads of ``kv_head`` of each of its ``q_count``
    requests (ids at ``q_index[q_start:]``) in turn. Per row: its request, head, index among the
    item's requests, and whether it is real (rows past the requests are padding)."""
    rows = tl.arange(0, BLOCK_Q)
    local = rows // GROUP
    row_ok = local < q_count
    request = tl.load(q_index_ptr + q_start + local, mask=row_ok, other=0).to(tl.int64)
    return request, kv_head * GROUP + rows % GROUP, local, row_ok


@triton.jit
def _query_tile(q_ptr, request, head, row_ok, stride_qr, stride_qh, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr):
    """The query tile of those rows (padding rows and dims past HEAD_DIM are zeros)."""
    dims = tl.arange(0, DIM_P2)
    return tl.load(q_ptr + request[:, None] * stride_qr + head[:, None] * stride_qh + dims[None, :],
                   mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _attend_block(q, k_ptr, v_ptr, kv_index_ptr, kv_start, kv_len, start, kv_head, m, row_sum, acc,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
                  PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr):
    """Tokens ``start : start + BLOCK_N`` of an item (pages through ``kv_index[kv_start:]``) into
    the online softmax state (running max ``m``, sum ``row_sum``, ``acc``) of the query tile ``q``."""
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    tokens = start + tl.arange(0, BLOCK_N)
    tok_ok = tokens < kv_len
    page = tl.load(kv_index_ptr + kv_start + tokens // PAGE, mask=tok_ok, other=0).to(tl.int64)
    slot = tokens % PAGE
    k = tl.load(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                mask=tok_ok[:, None] & dim_ok[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(tok_ok[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                mask=tok_ok[:, None] & dim_ok[None, :], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, row_sum, acc


@triton.jit
def _write_result(out_ptr, lse_ptr, acc, m, row_sum, request, head, local, row_ok, out_row,
                  stride_or, stride_oh, stride_lr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, DIRECT: tl.constexpr):
    """An item's rows: its final output (DIRECT: a request's only item, row = the request), or one
    fp32 partial (out, natural-log lse) per request at ``out_row + local``."""
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    out = acc / row_sum[:, None]
    if DIRECT:
        target = request[:, None] * stride_or + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + target, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        partial = (out_row + local).to(tl.int64)
        tl.store(out_ptr + partial[:, None] * stride_or + head[:, None] * stride_oh + dims[None, :], out,
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(lse_ptr + partial * stride_lr + head, (m + tl.log2(row_sum)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _merge_partials(
    part_ptr, lse_ptr, indptr_ptr, rows_ptr, out_ptr,
    stride_pr, stride_ph, stride_lr, stride_or, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, ROWS: tl.constexpr,
):
    # One program per (request, query head). A request's partial rows are read ROWS at a time as one
    # gather (not one dependent load after another), then reduced: usually a single chunk.
    request = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(indptr_ptr + request)
    last = tl.load(indptr_ptr + request + 1)
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([DIM_P2], tl.float32)
    for start in range(first, last, ROWS):
        index = start + tl.arange(0, ROWS)
        row_ok = index < last
        row = tl.load(rows_ptr + index, mask=row_ok, other=0).to(tl.int64)
        lse = tl.load(lse_ptr + row * stride_lr + head, mask=row_ok, other=float("-inf"))
        part = tl.load(part_ptr + row[:, None] * stride_pr + head * stride_ph + dims[None, :],
                       mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        weight = tl.exp(lse - m_new)  # padded rows: exp(-inf) = 0
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(weight, 0)
        acc = acc * alpha + tl.sum(weight[:, None] * part, 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)  # a request without rows (padding) gets zeros
    tl.store(out_ptr + request * stride_or + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def _launch(launch: DeviceLaunch, work: DeviceWork, query, key_cache, value_cache, out, lse, scale: float) -> None:
    head_dim = query.shape[2]
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    block_q = max(16, triton.next_power_of_2(launch.requests_per_tile * group))
    tuning = work.tuning
    config = tuning.node if launch.requests_per_tile > 1 else tuning.single
    per_sm = config.programs_per_sm or tuning.programs_per_sm
    programs = max(1, min(launch.items.shape[1], int(per_sm * device_sms(query.device)) // num_kv_heads))
    fit_key = (query.device, query.dtype, head_dim, block_q, config.block_n, config.num_stages)
    launch_fitting_stages(fit_key, config.num_stages, lambda stages: _partial_attention[(programs, num_kv_heads)](
        query, key_cache, value_cache, work.kv_index, work.q_index, launch.items, launch.count,
        out, lse,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), launch.items.stride(0),
        scale * LOG2E,
        GROUP=group, PAGE=page, HEAD_DIM=head_dim, DIM_P2=triton.next_power_of_2(head_dim), BLOCK_Q=block_q,
        BLOCK_N=config.block_n, DIRECT=work.direct, IEEE=query.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=stages,
    ))


def launch_fitting_stages(key: tuple, stages: int, launch: Callable[[int], object]) -> None:
    """``launch(stages)``, with fewer software-pipeline stages where ``stages`` do not fit the
    device's shared memory (Triton raises before anything runs); the stages that fit are
    remembered per ``key`` (device, dtype and tile of the launch)."""
    stages = _fitted_stages.get(key, stages)
    while True:
        try:
            launch(stages)
            return
        except OutOfResources:
            if stages == 1:
                raise
            stages = _fitted_stages[key] = stages - 1


def triton_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            work: DeviceWork, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over prepared work items (inputs already validated; see ``plan_work``).
    Returns ``[num_requests, num_q_heads, head_dim]`` in the query dtype (written into ``out`` when
    given: any strides, last dim contiguous). The caches may be strided views (e.g. vLLM's
    ``kv_cache.unbind(1)``) as long as their last dim is contiguous. A request with no work
    (padding) gets zeros. Launches a fixed number of kernels with fixed grids, so it can be
    captured in a CUDA graph."""
    num_requests, num_q_heads, head_dim = query.shape
    out = torch.empty_like(query) if out is None else out
    if num_requests == 0:
        return out
    if work.direct:
        _launch(work.single, work, query, key_cache, value_cache, out, out, scale)
        return out
    _launch_partials(work, query, key_cache, value_cache, scale)
    _merge(work, out)
    return out


def _merge(work: DeviceWork, out: torch.Tensor) -> None:
    """Each request's partial rows into its output row (``out``: [requests, q_heads, head_dim])."""
    num_requests, num_q_heads, head_dim = out.shape
    _merge_partials[(num_requests, num_q_heads)](
        work.partial, work.lse, work.merge_indptr, work.merge_rows, out,
        work.partial.stride(0), work.partial.stride(1), work.lse.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_P2=triton.next_power_of_2(head_dim), ROWS=work.tuning.merge_rows,
        num_warps=work.tuning.merge_warps,
    )


def _launch_partials(work: DeviceWork, query, key_cache, value_cache, scale: float) -> None:
    """The node and single launches, on two streams where that can help (CUDA, both present)."""
    if work.node is None or not query.is_cuda or not work.tuning.overlap_launches:
        for launch in (work.node, work.single):
            if launch is not None:
                _launch(launch, work, query, key_cache, value_cache, work.partial, work.lse, scale)
        return
    main = torch.cuda.current_stream(query.device)
    side = _side_streams.get(query.device)
    if side is None:
        side = _side_streams[query.device] = torch.cuda.Stream(query.device)
    side.wait_stream(main)  # fork: the side stream sees this step's query and cache writes
    with torch.cuda.stream(side):
        _launch(work.node, work, query, key_cache, value_cache, work.partial, work.lse, scale)
    _launch(work.single, work, query, key_cache, value_cache, work.partial, work.lse, scale)
    main.wait_stream(side)  # join: the merge (and any later free of the inputs) waits for both
