# A record, not maintained (last run at commit b95486a): FCA's two decode passes on FlashAttention-3's paged kernels.
"""FlashAttention-3's paged decode kernels (vLLM 0.24's build) for FCA's two passes, against the Triton kernels.

Each FCA decode step reads every shared prompt once (the node pass: a prompt's samples as one
sequence of queries over its blocks) and each sample's own tokens (the single pass), then merges
the two with their log-sum-exp. This times both passes as FlashAttention-3 launches (paged KV
through block tables, grouped-query heads packed into the query tile, split-KV as its heuristic or
as asked) against the library's Triton launches on the same batch, each replayed from a CUDA graph
layer after layer (``fca_common.per_layer_us``), and checks the merged output against the exact
torch computation.

FlashAttention-3 comes from vLLM's wheel (``vllm.vllm_flash_attn``) or, without vLLM, from the
extension module alone (``--fa3-dir``: a folder holding ``_vllm_fa3_C.abi3.so``).

    python3 bench/fa3_decode.py --shapes 8/8/2048,8/8/4096,16/16/4096,64/8/2048 --splits '[0, 1, 2, 4]'
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from arctic_fca.fca import fca_attention_with_lse
from arctic_fca.fca import triton_decode as td
from arctic_fca.fca.decode import prepare_decode
from fca_common import (GPU_SUFFIX, QWEN3_1_7B_HEADS, attention_args, build_batch, copy_bandwidth_bytes_per_s,
                        describe, layer_copies, max_abs_diff, parse_shapes, per_layer_us)


def load_fa3(folder: str | None):
    """FlashAttention-3's forward op (``torch.ops._vllm_fa3_C.fwd``)."""
    try:
        from vllm.vllm_flash_attn import _vllm_fa3_C
    except ImportError:
        if folder is None:
            sys.exit("no vLLM here: pass --fa3-dir, a folder holding _vllm_fa3_C.abi3.so")
        sys.path.insert(0, folder)
        import _vllm_fa3_C  # noqa: F401
    return torch.ops._vllm_fa3_C.fwd


def fa3_pass(fwd, q, k_cache, v_cache, cu_q, used_k, max_q: int, max_k: int, table, scale: float, splits: int,
             pack_gqa: bool | None):
    """One paged FlashAttention-3 launch: (out [T, Hq, D] in q's dtype, lse [Hq, T] fp32, natural log)."""
    out, lse, *_ = fwd(q, k_cache, v_cache, None, None, None, None, cu_q, None, None, None, used_k, max_q, max_k, table,
                       None, None, None, None, None, None, None, None, scale, False, -1, -1, 0.0, True, None, splits,
                       pack_gqa, 0, None, 1, 0, None)
    return out, lse


def merge(o1, l1, o2, l2):
    """Two attention states over disjoint keys into one (torch; for the check)."""
    l1, l2 = l1.t()[..., None], l2.t()[..., None]
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(o1.dtype)


def case(fwd, groups: int, samples: int, prefix: int, splits: list[int], pack: list, copy_bw: float) -> list[dict]:
    heads = QWEN3_1_7B_HEADS
    batch = build_batch(groups, samples, prefix, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **heads)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    block = key_cache.shape[1]
    scale = 1 / math.sqrt(heads["head_dim"])
    requests, shared_blocks = query.shape[0], prefix // block
    ints = dict(dtype=torch.int32, device="cuda")
    node = dict(cu_q=torch.arange(0, requests + 1, samples, **ints), used_k=torch.full((groups,), prefix, **ints),
                max_q=samples, max_k=prefix, table=tables[::samples, :shared_blocks].contiguous())
    single = dict(cu_q=torch.arange(0, requests + 1, **ints), used_k=torch.full((requests,), GPU_SUFFIX, **ints),
                  max_q=1, max_k=GPU_SUFFIX, table=tables[:, shared_blocks:].contiguous())
    plain = dict(cu_q=single["cu_q"], used_k=lens.int(), max_q=1, max_k=prefix + GPU_SUFFIX, table=tables)
    caches = layer_copies(key_cache, value_cache)
    exact = fca_attention_with_lse(query, key_cache, value_cache, tables, scale, describe(batch)["plan"])[0]
    shape = f"{groups}x{samples}@{prefix}"
    unique_bytes = describe(batch)["bytes"].unique_kv

    prepared = prepare_decode(tables.cpu(), lens.cpu(), block, mode="fca", dtype=query.dtype, device="cuda", **heads)
    work = prepared.work
    ours = {"node": lambda layer: td._launch(work.node, work, query, *caches[layer], work.partial, work.lse, scale),
            "single": lambda layer: td._launch(work.single, work, query, *caches[layer], work.partial, work.lse, scale),
            "both": lambda layer: td._launch_partials(work, query, *caches[layer], scale),
            "step": lambda layer: prepared(query, *caches[layer], scale)}
    rows = [{"shape": shape, "kernels": "triton", **{f"{k}_us": round(per_layer_us(f), 1) for k, f in ours.items()},
             "max_abs_diff": max_abs_diff(prepared(query, key_cache, value_cache, scale), exact)}]
    rows[0]["step_unique_bw"] = round(unique_bytes / (rows[0]["step_us"] * 1e-6) / copy_bw, 3)
    print(rows[0], flush=True)
    for split, pack_gqa in [(s, p) for s in splits for p in pack]:
        def run(args, layer, split=split, pack_gqa=pack_gqa):
            return fa3_pass(fwd, query, *caches[layer], args["cu_q"], args["used_k"], args["max_q"], args["max_k"],
                            args["table"], scale, split, pack_gqa)

        try:
            o1, l1 = run(node, 0)
            o2, l2 = run(single, 0)
            diff = max_abs_diff(merge(o1, l1, o2, l2), exact)
            timed = {"node": lambda layer: run(node, layer), "single": lambda layer: run(single, layer),
                     "both": lambda layer: (run(node, layer), run(single, layer)),
                     "plain": lambda layer: run(plain, layer)}
            row = {"shape": shape, "kernels": f"fa3 splits={split} pack_gqa={pack_gqa}",
                   **{f"{k}_us": round(per_layer_us(f), 1) for k, f in timed.items()}, "max_abs_diff": diff}
        except Exception as error:  # noqa: BLE001 - a setting the build refuses is reported, not fatal
            row = {"shape": shape, "kernels": f"fa3 splits={split} pack_gqa={pack_gqa}", "error": repr(error)[:300]}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes,
                        default=[(8, 8, 2048), (8, 8, 4096), (16, 16, 4096), (64, 8, 2048)],
                        help="G/S/P,...: groups/samples/prompt length (Qwen3-1.7B heads, 256 own tokens)")
    parser.add_argument("--splits", type=json.loads, default=[0, 1, 2, 4],
                        help="FlashAttention-3 split-KV counts (0: its heuristic)")
    parser.add_argument("--pack-gqa", type=json.loads, default=[None],
                        help="pack_gqa settings (null: its heuristic)")
    parser.add_argument("--fa3-dir", help="a folder holding _vllm_fa3_C.abi3.so, where vLLM is not installed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fa3_decode.py times GPU kernels: no CUDA device here")
    fwd = load_fa3(args.fa3_dir)
    print(fwd.default._schema, flush=True)
    copy_bw = copy_bandwidth_bytes_per_s()
    rows = [row for shape in args.shapes for row in case(fwd, *shape, args.splits, args.pack_gqa, copy_bw)]
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_tb_s": round(copy_bw / 1e12, 3), "rows": rows}))


if __name__ == "__main__":
    main()
