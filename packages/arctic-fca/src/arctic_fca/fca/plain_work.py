"""The plain work of a decode step in one Triton program (``DeviceWorkBuilder.build(shared=False)``).

A step whose requests share no block is read plain: each request's KV split into pieces of one
length, no node items. Written with torch ops that is ~55 tiny kernels, whose GPU time, even
replayed from a CUDA graph, is paid exactly where FCA has nothing to gain. One program does it in
one launch: the requests fit one block of lanes, so the piece counts' prefix sum is a ``tl.cumsum``.

It writes what the torch build writes and the kernels read (``same_work``): the single items and
their count, an empty node launch, each request's query row, and the merge ranges; items past the
count and merge rows past the last range are left as they are (nothing reads them).

The default on CUDA (``DeviceWorkBuilder(plain_kernel=False)`` turns it off): a replayed build is
faster than the torch ops' and writes the same work bit for bit (``bench/fca_device_work.py
--plain-cost``; figures in docs/design/fca.md); the CPU suite checks it under Triton's interpreter.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from arctic_fca.fca.work import DeviceWork


# One compiled program for every batch size: Triton would otherwise specialize the request count
# (1, multiples of 16, the rest) and compile again inside an engine's first steps.
@triton.jit(do_not_specialize=["num_requests"])
def _plain_work(
    lens_ptr, items_ptr, count_ptr, node_count_ptr, q_index_ptr, merge_indptr_ptr, merge_rows_ptr,
    num_requests, width, target, max_pairs, stride_items,
    PAGE: tl.constexpr, CHUNK_LO: tl.constexpr, CHUNK_HI: tl.constexpr, DOUBLINGS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    request = tl.arange(0, BLOCK_R)
    live = request < num_requests
    lens = tl.load(lens_ptr + request, mask=live, other=0)
    total = tl.sum(lens, axis=0)
    # Split length: the least power of two p with p * target >= total, clamped to the chunk range
    # (``DeviceWorkBuilder._chunk``'s 2 ** ceil(log2(total / target)), in integers).
    chunk = total * 0 + 1
    for _ in tl.static_range(DOUBLINGS):
        chunk = tl.where((chunk < CHUNK_HI) & (chunk * target < total), chunk * 2, chunk)
    chunk = tl.minimum(tl.maximum(chunk, CHUNK_LO), CHUNK_HI)
    pieces = tl.where(live, (lens + chunk - 1) // chunk, 0)
    ends = tl.cumsum(pieces, axis=0)
    starts = ends - pieces
    for piece in range(0, tl.max(pieces, axis=0)):
        has = piece < pieces
        slot = items_ptr + starts + piece
        tl.store(slot, request * width + piece * (chunk // PAGE), mask=has)  # kv_start
        tl.store(slot + stride_items, tl.minimum(chunk, lens - piece * chunk), mask=has)  # kv_len
        tl.store(slot + 2 * stride_items, max_pairs + request, mask=has)  # q_start: the request's row
        tl.store(slot + 3 * stride_items, tl.full([BLOCK_R], 1, tl.int32), mask=has)  # q_count
        tl.store(slot + 4 * stride_items, starts + piece, mask=has)  # out_row: items in request order
    num_items = tl.sum(pieces, axis=0)
    tl.store(count_ptr, num_items)
    tl.store(node_count_ptr, 0)
    tl.store(q_index_ptr + max_pairs + request, request, mask=live)
    tl.store(merge_indptr_ptr + 1 + request, ends, mask=live)
    tl.store(merge_indptr_ptr, 0)  # every step: a woken engine's memory may hold anything
    for first in range(0, num_items, BLOCK_ROWS):  # each request's rows are its items
        row = first + tl.arange(0, BLOCK_ROWS)
        tl.store(merge_rows_ptr + row, row, mask=row < num_items)


def write_plain_work(work: DeviceWork, lens: torch.Tensor, *, num_requests: int, width: int, block_size: int,
                     target: int, max_pairs: int, chunk_range: tuple[int, int], max_requests: int) -> None:
    """Write the plain work of the first ``num_requests`` lengths of ``lens`` (int32, on the
    work's device) into ``work``: what ``DeviceWorkBuilder._build_plain`` writes with torch ops."""
    low, high = chunk_range
    _plain_work[(1,)](
        lens, work.single.items, work.single.count, work.node.count, work.q_index, work.merge_indptr,
        work.merge_rows, num_requests, width, target, max_pairs, work.single.items.stride(0),
        PAGE=block_size, CHUNK_LO=low, CHUNK_HI=high, DOUBLINGS=max(1, math.ceil(math.log2(high))),
        BLOCK_R=triton.next_power_of_2(max_requests), BLOCK_ROWS=1024, num_warps=4,
    )
