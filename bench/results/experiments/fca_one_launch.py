# A record, not maintained (last run at commit 477f763): both FCA decode passes in one persistent launch.
"""Both FCA passes in ONE launch, against the library's two (a measured alternative, kept as a
record; the library keeps two launches).

The library (``arctic_fca.fca.triton_decode``) runs a decode step's attention as two launches of
one partial-attention kernel side by side on two CUDA streams (the shared-node items, the
one-request suffix items) and a merge launch. Each program pipelines the KV blocks of one item
at a time, so every item starts with an empty pipeline. ``_one_launch_attention`` here takes
both item lists in one persistent launch and runs all the blocks of a program's items as one
loop, so the pipeline runs on across item boundaries (the current item's columns are picked from
registers by arithmetic: a load between one block's place and the next stops Triton's software
pipelining, as ``MLIR_ENABLE_DUMP`` / the TTGIR shows). ``--merge`` also folds the merge in: each
(request, head) counts its partial rows as they are written and the program writing the last
merges them.

GPU (no flag): Qwen3-1.7B attention heads, bf16, 256-token suffixes (``fca_common.build_batch``);
per shape, the library's step and each one-launch setting, replayed from CUDA graphs layer after
layer (``fca_common.per_layer_us``), with each one's largest difference from the exact torch
FCA. ``--smoke`` (CPU, under ``TRITON_INTERPRET=1``): the kernel against plain paged decode on
small random batches, FCA and plain work, merge on and off (run twice on the same work, as the
layers of a step do).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from arctic_fca.fca import fca_attention_with_lse
from arctic_fca.fca.decode import prepare_decode
from arctic_fca.fca.reference import paged_decode_attention
from arctic_fca.fca.triton_decode import (LOG2E, _attend_block, _merge, _query_rows, _query_tile, _write_result,
                                          launch_fitting_stages)
from arctic_fca.fca.work import DeviceWork, device_sms
from fca_common import (QWEN3_1_7B_HEADS, GPU_SUFFIX, attention_args, build_batch, describe, layer_copies,
                        max_abs_diff, parse_shapes, per_layer_us, tuning_of)


@dataclass(frozen=True)
class OneLaunch:
    """A setting of the one-launch kernel. ``node_tile_rows`` is the work's (``Tuning``): the
    launch's query tile is as tall as a node item's, so 16 rows spare the suffix items' MMAs."""

    node_tile_rows: int = 16
    programs_per_sm: int = 2  # programs (x KV heads) per SM: as many as fit at once
    num_stages: int = 7  # Triton stages: the page and KV buffers it gets depend on the loop's chain
    num_warps: int = 4
    block_n: int = 64
    merge: bool = False


@triton.jit
def _one_launch_attention(
    q_ptr, k_ptr, v_ptr, kv_index_ptr, q_index_ptr, node_ptr, node_count_ptr, single_ptr, single_count_ptr,
    out_ptr, lse_ptr, final_ptr, indptr_ptr, rows_ptr, arrivals_ptr, num_requests,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_or, stride_oh, stride_lr, stride_node, stride_single, stride_fr, stride_fh, stride_ar,
    scale_log2,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, ITEMS_P2: tl.constexpr, HAS_NODES: tl.constexpr, DIRECT: tl.constexpr,
    MERGE: tl.constexpr, IEEE: tl.constexpr,
):
    """Both item lists (node items, then single items) in one persistent launch. A program takes
    items ``program, program + programs, ...`` and runs all their KV blocks as ONE loop, so the
    software pipeline keeps loading across item boundaries instead of draining and refilling at
    each item (the items of a decode step are short: a few blocks each).

    MERGE: no merge launch either. Each (request, head) counts its partial rows as they are
    written (``arrivals``); the program writing the last one merges them into ``final`` and resets
    the count. Requests without rows (padding) get zeros at the end."""
    kv_head = tl.program_id(1)
    first, programs = tl.program_id(0), tl.num_programs(0)
    node_count = 0
    if HAS_NODES:
        node_count = tl.load(node_count_ptr)
    total = node_count + tl.load(single_count_ptr)
    # This program's items, their columns gathered into registers at once: the loop below picks
    # the current item's by arithmetic, so no load sits between one block's place and the next
    # (the software pipeline then runs the page and KV loads stages ahead).
    slots = tl.arange(0, ITEMS_P2)
    mine = first + programs * slots
    in_node = mine < node_count
    in_single = ~in_node & (mine < total)
    kv_starts = _item_column(node_ptr, single_ptr, mine, node_count, in_node, in_single, 0, stride_node, stride_single)
    kv_lens = _item_column(node_ptr, single_ptr, mine, node_count, in_node, in_single, 1, stride_node, stride_single)
    q_starts = _item_column(node_ptr, single_ptr, mine, node_count, in_node, in_single, 2, stride_node, stride_single)
    q_counts = _item_column(node_ptr, single_ptr, mine, node_count, in_node, in_single, 3, stride_node, stride_single)
    out_rows = _item_column(node_ptr, single_ptr, mine, node_count, in_node, in_single, 4, stride_node, stride_single)
    blocks = tl.sum((kv_lens + BLOCK_N - 1) // BLOCK_N)

    slot = 0  # which of this program's items the block belongs to
    start = 0
    q = tl.zeros([BLOCK_Q, DIM_P2], q_ptr.dtype.element_ty)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, DIM_P2], tl.float32)
    for _ in range(0, blocks):
        here = slots == slot
        kv_start = tl.sum(tl.where(here, kv_starts, 0))
        kv_len = tl.sum(tl.where(here, kv_lens, 0))
        q_start = tl.sum(tl.where(here, q_starts, 0))
        q_count = tl.sum(tl.where(here, q_counts, 0))
        if start == 0:  # a new item: its queries, a fresh softmax state
            request, head, local, row_ok = _query_rows(q_index_ptr, q_start, q_count, kv_head, GROUP, BLOCK_Q)
            q = _query_tile(q_ptr, request, head, row_ok, stride_qr, stride_qh, HEAD_DIM, DIM_P2)
            m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        m, row_sum, acc = _attend_block(q, k_ptr, v_ptr, kv_index_ptr, kv_index_ptr, kv_index_ptr, m, kv_start,
                                        kv_len, start, kv_head, m, row_sum, acc,
                                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                        scale_log2, PAGE, HEAD_DIM, DIM_P2, BLOCK_N, IEEE, False)
        last = start + BLOCK_N >= kv_len
        if last:  # the item's last block: its rows are done
            request, head, local, row_ok = _query_rows(q_index_ptr, q_start, q_count, kv_head, GROUP, BLOCK_Q)
            out_row = tl.sum(tl.where(here, out_rows, 0))
            _write_result(out_ptr, lse_ptr, acc, m, row_sum, request, head, local, row_ok, out_row,
                          stride_or, stride_oh, stride_lr, HEAD_DIM, DIM_P2, DIRECT)
            if MERGE:
                _merge_on_last_arrival(out_ptr, lse_ptr, final_ptr, indptr_ptr, rows_ptr, arrivals_ptr, request,
                                       head, row_ok, stride_or, stride_oh, stride_lr, stride_fr, stride_fh,
                                       stride_ar, HEAD_DIM, DIM_P2, BLOCK_Q)
        # The next block's place, by arithmetic outside the branches above: the software pipeline
        # computes it stages ahead of the softmax that those branches wait for.
        slot = tl.where(last, slot + 1, slot)
        start = tl.where(last, 0, start + BLOCK_N)
    if MERGE:
        _zero_requests_without_rows(final_ptr, indptr_ptr, num_requests, kv_head, first, programs, stride_fr,
                                    stride_fh, GROUP, HEAD_DIM, DIM_P2, BLOCK_Q)


@triton.jit
def _item_column(node_ptr, single_ptr, item, node_count, in_node, in_single, column, stride_node, stride_single):
    """Column ``column`` of items ``item`` of the node list followed by the single list (0 elsewhere)."""
    return (tl.load(node_ptr + column * stride_node + item, mask=in_node, other=0)
            + tl.load(single_ptr + column * stride_single + (item - node_count), mask=in_single, other=0))


@triton.jit
def _merge_on_last_arrival(part_ptr, lse_ptr, final_ptr, indptr_ptr, rows_ptr, arrivals_ptr, request, head, row_ok,
                           stride_pr, stride_ph, stride_lr, stride_fr, stride_fh, stride_ar,
                           HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Count this item's rows in; the rows (request, head) whose count is now complete are merged
    here, from the partials every program wrote (read through L2: other SMs wrote them)."""
    first = tl.load(indptr_ptr + request, mask=row_ok, other=0)
    parts = tl.load(indptr_ptr + request + 1, mask=row_ok, other=0) - first
    # Every thread's partial stores above come before this program's arrivals (release), and the
    # reads below come after every thread's view of the arrivals (acquire), as in a semaphore.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + request * stride_ar + head, 1, mask=row_ok, sem="acq_rel")
    tl.debug_barrier()
    last = row_ok & (arrived == parts - 1)
    if tl.max(last.to(tl.int32), 0) > 0:
        dims = tl.arange(0, DIM_P2)
        dim_ok = dims < HEAD_DIM
        m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, DIM_P2], tl.float32)
        for j in range(0, tl.max(tl.where(last, parts, 0), 0)):
            take = last & (j < parts)
            row = tl.load(rows_ptr + first + j, mask=take, other=0).to(tl.int64)
            lse = tl.load(lse_ptr + row * stride_lr + head, mask=take, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(part_ptr + row[:, None] * stride_pr + head[:, None] * stride_ph + dims[None, :],
                           mask=take[:, None] & dim_ok[None, :], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse)
            pivot = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows not merged: no inf - inf
            weight = tl.exp(lse - pivot)  # rows not taken: exp(-inf) = 0
            alpha = tl.exp(m - pivot)
            total = total * alpha + weight
            acc = acc * alpha[:, None] + weight[:, None] * part
            m = m_new
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(final_ptr + request[:, None] * stride_fr + head[:, None] * stride_fh + dims[None, :],
                 out.to(final_ptr.dtype.element_ty), mask=last[:, None] & dim_ok[None, :])
        tl.atomic_xchg(arrivals_ptr + request * stride_ar + head, 0, mask=last)  # ready for the next launch


@triton.jit
def _zero_requests_without_rows(final_ptr, indptr_ptr, num_requests, kv_head, first, programs, stride_fr, stride_fh,
                                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                                BLOCK_Q: tl.constexpr):
    """Zeros for the requests with no partial rows (padding of a CUDA graph's batch), as the merge
    launch writes: this program's share of the requests, ``BLOCK_Q // GROUP`` at a time."""
    per_step: tl.constexpr = BLOCK_Q // GROUP
    rows = tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, DIM_P2)
    head = kv_head * GROUP + rows % GROUP
    for base in range(first * per_step, num_requests, programs * per_step):
        request = base + rows // GROUP
        real = request < num_requests
        empty = real & (tl.load(indptr_ptr + request + 1, mask=real, other=0)
                        == tl.load(indptr_ptr + request, mask=real, other=0))
        tl.store(final_ptr + request[:, None] * stride_fr + head[:, None] * stride_fh + dims[None, :],
                 tl.zeros([BLOCK_Q, DIM_P2], tl.float32).to(final_ptr.dtype.element_ty),
                 mask=empty[:, None] & (dims < HEAD_DIM)[None, :])


def one_launch_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, work: DeviceWork,
                         scale: float, setting: OneLaunch) -> torch.Tensor:
    """``triton_decode_attention``'s result from one launch (and the merge launch unless
    ``setting.merge``; the in-launch merge's counts are kept with ``work``: ``_arrivals``)."""
    out = torch.empty_like(query)
    head_dim = query.shape[2]
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    node = work.node if work.node is not None else work.single  # not read: HAS_NODES is off
    block_q = max(16, triton.next_power_of_2(max(node.requests_per_tile, work.single.requests_per_tile) * group))
    programs = max(1, setting.programs_per_sm * device_sms(query.device) // num_kv_heads)
    capacity = node.items.shape[1] + work.single.items.shape[1]
    direct, merge = work.direct, setting.merge and not work.direct
    parts, lse = (out, out) if direct else (work.partial, work.lse)
    arrivals = _arrivals(work)
    fit_key = ("one", query.device, query.dtype, head_dim, block_q, setting.block_n, setting.num_stages)
    launch_fitting_stages(fit_key, setting.num_stages, lambda stages: _one_launch_attention[(programs, num_kv_heads)](
        query, key_cache, value_cache, work.kv_index, work.q_index, node.items, node.count,
        work.single.items, work.single.count, parts, lse, out, work.merge_indptr, work.merge_rows, arrivals,
        query.shape[0],
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        parts.stride(0), parts.stride(1), lse.stride(0), node.items.stride(0), work.single.items.stride(0),
        out.stride(0), out.stride(1), arrivals.stride(0),
        scale * LOG2E,
        GROUP=group, PAGE=page, HEAD_DIM=head_dim, DIM_P2=triton.next_power_of_2(head_dim), BLOCK_Q=block_q,
        BLOCK_N=setting.block_n, ITEMS_P2=triton.next_power_of_2(triton.cdiv(capacity, programs)),
        HAS_NODES=work.node is not None, DIRECT=direct, MERGE=merge, IEEE=query.dtype == torch.float32,
        num_warps=setting.num_warps, num_stages=stages,
    ))
    if not direct and not merge:
        _merge(work, out)
    return out


def _arrivals(work: DeviceWork) -> torch.Tensor:
    """[requests, q_heads] int32 counts kept with ``work``, zero between launches (the merging
    program resets what it counted); made by a first, eager call, before any CUDA graph capture."""
    if not hasattr(work, "arrivals"):
        work.arrivals = torch.zeros(work.merge_indptr.numel(), work.lse.shape[1], dtype=torch.int32,
                                    device=work.lse.device)
    return work.arrivals


# ----------------------------------------------------------------------------- CPU smoke

SMOKE_CASES = [(1, 8, 64, 5), (2, 4, 16, 1), (3, 3, 32, 40), (4, 1, 48, 17), (2, 5, 16, 70)]  # G, S, prefix, suffix


def smoke() -> dict:
    assert os.environ.get("TRITON_INTERPRET") == "1", "--smoke runs the kernel under TRITON_INTERPRET=1"
    worst, cases = 0.0, 0
    settings = [OneLaunch(programs_per_sm=1, node_tile_rows=rows, merge=merge)
                for rows, merge in itertools.product((16, 64), (False, True))]
    heads = dict(num_q_heads=8, num_kv_heads=2, head_dim=32)
    for i, (groups, samples, prefix, suffix) in enumerate(SMOKE_CASES):
        batch = build_batch(groups, samples, prefix, suffix, seed=i, **heads)
        query, key_cache, value_cache, tables, lens = attention_args(batch)
        expected = paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.3)
        for mode, setting in itertools.product(("fca", "plain"), settings):
            tuning = tuning_of({"node_tile_rows": setting.node_tile_rows, "min_chunk_tokens": 16})
            prepared = prepare_decode(tables, lens, key_cache.shape[1], mode=mode, dtype=query.dtype, kernel="triton",
                                      tuning=tuning, **heads)
            for _ in range(2):  # the same work twice, as a step's layers run it
                out = one_launch_attention(query, key_cache, value_cache, prepared.work, 0.3, setting)
                worst = max(worst, max_abs_diff(out, expected))
            cases += 1
    return {"max_abs_diff": worst, "cases": cases}


# ----------------------------------------------------------------------------- GPU timing


def gpu(shapes, settings: list[OneLaunch]) -> dict:
    heads, rows = QWEN3_1_7B_HEADS, []
    scale = 1 / math.sqrt(heads["head_dim"])
    for groups, samples, prefix in shapes:
        batch = build_batch(groups, samples, prefix, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **heads)
        query, key_cache, value_cache, block_tables, seq_lens = attention_args(batch)
        exact = fca_attention_with_lse(query, key_cache, value_cache, block_tables, scale, describe(batch)["plan"])[0]
        caches = layer_copies(key_cache, value_cache)

        def prepared(changes):
            return prepare_decode(block_tables.cpu(), seq_lens.cpu(), key_cache.shape[1], mode="fca", dtype=query.dtype,
                                  device="cuda", tuning=tuning_of(changes), **heads)

        library = prepared({})
        runs = {"two launches (library)": lambda layer: library(query, *caches[layer], scale)}
        for setting in settings:
            work = prepared({"node_tile_rows": setting.node_tile_rows}).work
            runs[json.dumps(asdict(setting))] = (lambda layer, work=work, setting=setting:
                                                 one_launch_attention(query, *caches[layer], work, scale, setting))
        for name, run in runs.items():
            diff = max_abs_diff(run(0), exact)  # eager first: compiles, and makes the arrival counts
            row = {"shape": f"{groups}x{samples}@{prefix}", "launch": name, "us": round(per_layer_us(run), 1),
                   "max_abs_diff_vs_torch": diff}
            print(row, flush=True)
            rows.append(row)
    return {"device": torch.cuda.get_device_name(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU exactness check under TRITON_INTERPRET=1")
    parser.add_argument("--shapes", type=parse_shapes,
                        default=[(8, 8, 2048), (8, 8, 4096), (16, 16, 4096), (64, 8, 2048)],
                        help="G/S/P,...: groups/samples/prefix")
    parser.add_argument("--settings", type=json.loads, default=[{}],
                        help='JSON list of OneLaunch overrides, e.g. [{}, {"merge": true}]')
    args = parser.parse_args()
    if args.smoke:
        print(json.dumps(smoke()))
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke under TRITON_INTERPRET=1 for the CPU check")
    else:
        print(json.dumps(gpu(args.shapes, [OneLaunch(**changes) for changes in args.settings])))


if __name__ == "__main__":
    main()
