# A record, not maintained (last run at commit 5be02a7): FCA with each prompt group's own tokens in its query tile.
"""FCA decode attention with each prompt group's own tokens read by the group's query tile, in one launch.

The library reads a decode step's KV in two launches side by side: the shared-prompt pass (one
query tile per prompt: its samples' heads) and the suffix pass (one program per sample and KV head,
a 16-row tile with 2 real rows, ~256 tokens), then merges. Both are short launches whose ramp-up
and tail cost about as much as their bytes at 8 x 8 @ 2048. Here a group's samples' own tokens are
read by the group's own query tile too, each token visible only to the rows of the sample that
owns it (a per-page owner: -1 for the prompt's pages, else the sample), so that:

- ``one``: a single launch reads the whole step, each item a piece of one group's pages (prompt
  pages first, then each sample's own pages): uniform items, no second stream, no join;
- ``two``: the prompt pieces and the own-token pieces as two launches one after the other (the own
  tokens of several samples per item, in a tall tile, instead of one sample per item).

Each variant's partial rows are merged by the library's merge kernel and checked against the exact
torch computation; times are per layer from CUDA graphs (``fca_common.per_layer_us``), against the
library's step on the same batch. ``--smoke`` runs the kernel on the CPU under TRITON_INTERPRET=1.

    python3 bench/fca_group_pass.py --shapes 8/8/2048,8/8/4096,16/16/4096,64/8/2048
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl

from arctic_fca.fca import fca_attention_with_lse
from arctic_fca.fca.decode import prepare_decode
from arctic_fca.fca.triton_decode import _merge_partials
from fca_common import (GPU_SUFFIX, QWEN3_1_7B_HEADS, attention_args, build_batch, copy_bandwidth_bytes_per_s,
                        describe, layer_copies, max_abs_diff, parse_shapes, per_layer_us, smoke_or_gpu)

LOG2E = 1.4426950408889634


@triton.jit
def _group_pass(q_ptr, k_ptr, v_ptr, pages_ptr, owner_ptr, valid_ptr, items_ptr, out_ptr, lse_ptr,
                stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_or, stride_oh, stride_lr, stride_items,
                scale_log2, GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_page = tl.load(items_ptr + item)
    num_pages = tl.load(items_ptr + stride_items + item)
    first_request = tl.load(items_ptr + 2 * stride_items + item)
    samples = tl.load(items_ptr + 3 * stride_items + item)
    out_row = tl.load(items_ptr + 4 * stride_items + item)
    rows = tl.arange(0, BLOCK_Q)
    local = rows // GROUP
    row_ok = local < samples
    request = (first_request + local).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + request[:, None] * stride_qr + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    for start in range(0, num_pages * PAGE, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        index = tokens // PAGE
        in_item = index < num_pages
        page = tl.load(pages_ptr + first_page + index, mask=in_item, other=0).to(tl.int64)
        owner = tl.load(owner_ptr + first_page + index, mask=in_item, other=-2)
        valid = tl.load(valid_ptr + first_page + index, mask=in_item, other=0)
        slot = tokens % PAGE
        tok_ok = in_item & (slot < valid)
        offsets = page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=tok_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = tok_ok[None, :] & ((owner[None, :] == -1) | (owner[None, :] == local[:, None]))
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets, mask=tok_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    seen = row_sum > 0
    out = acc / tl.where(seen, row_sum, 1.0)[:, None]
    partial = (out_row + local).to(tl.int64)
    tl.store(out_ptr + partial[:, None] * stride_or + head[:, None] * stride_oh + dims[None, :], out,
             mask=row_ok[:, None])
    lse = tl.where(seen, (m + tl.log2(tl.where(seen, row_sum, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + partial * stride_lr + head, lse, mask=row_ok)


class GroupWork:
    """Items over each group's pages (a group: ``samples`` consecutive requests sharing ``prefix``
    tokens of whole blocks, each then with its own blocks): pages, owners and valid tokens per page,
    items ``[5, n]`` (first page, pages, first request, samples, first partial row), and the merge's
    rows per request (prompt pieces first, so a request's first merge chunk holds a finite lse)."""

    def __init__(self, tables: torch.Tensor, lens: torch.Tensor, groups: int, samples: int, prefix: int, block: int,
                 prompt_pieces: int, own_pieces: int, device: str) -> None:
        prompt_blocks = prefix // block
        pages, owner, valid, items, rows = [], [], [], [[], []], [[] for _ in range(groups * samples)]
        next_row = 0

        def add(kind: int, group: int, group_pages: list[tuple[int, int, int]], pieces: int) -> None:
            nonlocal next_row
            size = math.ceil(len(group_pages) / pieces)
            for first in range(0, len(group_pages), size):
                piece = group_pages[first : first + size]
                items[kind].append([len(pages), len(piece), group * samples, samples, next_row])
                for page, own, count in piece:
                    pages.append(page), owner.append(own), valid.append(count)
                for sample in range(samples):
                    if any(own in (-1, sample) for _, own, _ in piece):
                        rows[group * samples + sample].append((kind, next_row + sample))
                next_row += samples

        for group in range(groups):
            leader = group * samples
            prompt = [(int(tables[leader, c]), -1, block) for c in range(prompt_blocks)]
            own = []
            for sample in range(samples):
                r = leader + sample
                n_own = int(lens[r]) - prefix
                for c in range(math.ceil(n_own / block)):
                    own.append((int(tables[r, prompt_blocks + c]), sample, min(block, n_own - c * block)))
            if own_pieces == 0:  # "one": a group's pages cut into prompt_pieces pieces, prompt first
                add(0, group, prompt + own, prompt_pieces)
            else:
                add(0, group, prompt, prompt_pieces)
                add(1, group, own, own_pieces)

        def ints(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        self.pages, self.owner, self.valid = ints(pages), ints(owner), ints(valid)
        self.launches = [ints(kind).t().contiguous() for kind in items if kind]
        ordered = [[row for _, row in sorted(entries)] for entries in rows]
        self.merge_indptr = ints([0, *torch.tensor([len(e) for e in ordered]).cumsum(0).tolist()])
        self.merge_rows = ints([row for entries in ordered for row in entries])
        self.num_rows, self.samples = next_row, samples


def group_attention(work: GroupWork, query, key_cache, value_cache, partial, lse, out, scale: float,
                    block_n: int, num_stages: int, num_warps: int = 4) -> torch.Tensor:
    group = query.shape[1] // key_cache.shape[2]
    samples = work.samples
    for items in work.launches:
        _group_pass[(items.shape[1], key_cache.shape[2])](
            query, key_cache, value_cache, work.pages, work.owner, work.valid, items, partial, lse,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            partial.stride(0), partial.stride(1), lse.stride(0), items.stride(0), scale * LOG2E,
            GROUP=group, PAGE=key_cache.shape[1], HEAD_DIM=query.shape[2],
            BLOCK_Q=max(16, triton.next_power_of_2(samples * group)), BLOCK_N=block_n,
            IEEE=query.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    _merge_partials[(query.shape[0], query.shape[1])](
        partial, lse, work.merge_indptr, work.merge_rows, out, partial.stride(0), partial.stride(1), lse.stride(0),
        out.stride(0), out.stride(1), HEAD_DIM=query.shape[2], DIM_P2=query.shape[2], ROWS=4, num_warps=1)
    return out


# (prompt pieces, own pieces) per group; own pieces 0: one launch over a group's prompt and own pages;
# prompt pieces 0: as many as make ~2 items per SM and KV head.
VARIANTS = [(0, 0), (4, 0), (8, 0), (4, 1), (4, 2), (4, 4)]


def run_case(groups: int, samples: int, prefix: int, suffix: int, heads: dict, dtype, device: str,
             settings: list[tuple[int, int]], timed: bool, variants=VARIANTS) -> list[dict]:
    batch = build_batch(groups, samples, prefix, suffix, dtype=dtype, device=device, **heads)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    scale = 1 / math.sqrt(heads["head_dim"])
    exact = fca_attention_with_lse(query, key_cache, value_cache, tables, scale, describe(batch)["plan"])[0]
    caches = layer_copies(key_cache, value_cache) if timed else [(key_cache, value_cache)]
    shape, rows = f"{groups}x{samples}@{prefix}", []
    if timed:
        prepared = prepare_decode(tables.cpu(), lens.cpu(), key_cache.shape[1], mode="fca", dtype=dtype, device=device,
                                  **heads)
        rows.append({"shape": shape, "variant": "library",
                     "us": round(per_layer_us(lambda layer: prepared(query, *caches[layer], scale)), 1),
                     "max_abs_diff": max_abs_diff(prepared(query, key_cache, value_cache, scale), exact)})
        print(rows[-1], flush=True)
    for prompt_pieces, own_pieces in variants:
        if prompt_pieces == 0:  # as many items per KV head as the library's split aims at: 2 per SM
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 8
            prompt_pieces = max(1, round(2 * sms / heads["num_kv_heads"] / groups))
        name = f"two/{prompt_pieces}+{own_pieces}" if own_pieces else f"one/{prompt_pieces}"
        work = GroupWork(tables.cpu(), lens.cpu(), groups, samples, prefix, key_cache.shape[1], prompt_pieces,
                         own_pieces, device)
        partial = torch.empty(work.num_rows, *query.shape[1:], dtype=torch.float32, device=device)
        lse = torch.empty(work.num_rows, query.shape[1], dtype=torch.float32, device=device)
        out = torch.empty_like(query)
        for block_n, stages in settings:
            def run(layer, block_n=block_n, stages=stages):
                return group_attention(work, query, *caches[layer], partial, lse, out, scale, block_n, stages)

            row = {"shape": shape, "variant": name, "block_n": block_n, "stages": stages,
                   "items": [int(i.shape[1]) for i in work.launches]}
            try:
                row["max_abs_diff"] = max_abs_diff(run(0), exact)
                if timed:
                    row["us"] = round(per_layer_us(run), 1)
            except Exception as error:  # noqa: BLE001 - a setting that does not fit is reported, not fatal
                row["error"] = repr(error)[:200]
            print(row, flush=True)
            rows.append(row)
    return rows


def smoke() -> dict:
    heads = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
    rows = [row for shape in ((2, 3, 32, 21), (1, 4, 48, 5), (3, 2, 16, 40))
            for row in run_case(*shape, heads, torch.float32, "cpu", [(16, 1)], timed=False)]
    return {"max_abs_diff": max(row["max_abs_diff"] for row in rows), "cases": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU exactness check (TRITON_INTERPRET=1)")
    parser.add_argument("--shapes", type=parse_shapes,
                        default=[(8, 8, 2048), (8, 8, 4096), (16, 16, 4096), (64, 8, 2048)],
                        help="G/S/P,...: groups/samples/prompt length (Qwen3-1.7B heads, 256 own tokens)")
    parser.add_argument("--settings", type=json.loads, default=[[64, 3], [64, 5]],
                        help="[block_n, num_stages] pairs of the group kernel")
    parser.add_argument("--variants", type=json.loads, default=VARIANTS,
                        help="[prompt pieces, own pieces] per group (own pieces 0: one launch for both)")
    args = parser.parse_args()
    if smoke_or_gpu(args.smoke, smoke, "bench/fca_group_pass.py"):
        return
    copy_bw = copy_bandwidth_bytes_per_s()
    rows = [row for shape in args.shapes
            for row in run_case(*shape, GPU_SUFFIX, QWEN3_1_7B_HEADS, torch.bfloat16, "cuda",
                                [tuple(s) for s in args.settings], timed=True, variants=args.variants)]
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_tb_s": round(copy_bw / 1e12, 3), "rows": rows}))


if __name__ == "__main__":
    main()
