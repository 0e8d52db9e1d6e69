"""FCA decode kernels against the plain computation: exactness (CPU, --smoke) and speed (GPU).

--smoke (CPU, < 1 min): GRPO-shaped paged batches (an optional system prompt shared by all, a
prompt per group, a suffix per sample; singletons; block sizes 16 and 32), FCA vs the plain paged
computation in fp32; prints the largest difference.

GPU (no flag): Qwen3-8B attention shape (32 q heads, 8 KV heads, head_dim 128, bf16, block 16),
groups x samples = 1x64, 8x16, 32x8, 128x1, prefix 1024 / 4096 / 16384, suffix 256. Times, in the
same process: the Triton FCA kernels, the same Triton kernel as a plain FlashDecoding-style paged
decode (every request reads its whole KV, split-K), the cost model's pick between them ("auto"),
and torch SDPA over KV already gathered per request, each replayed from a CUDA graph as an engine's
decode step runs them (layer after layer, each layer with KV of its own); and the exact torch FCA
path, eagerly. Reports the bandwidth FCA reaches on the unique KV bytes against the copy
bandwidth measured in the process.

--breakdown (GPU): where an FCA step's time goes, launch by launch.

The last line printed is a JSON object of all results. Launch settings: bench/fca_sweep.py; the
vLLM path's device-built work: bench/fca_device_work.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from arctic_fca.fca import fca_attention_with_lse, fca_decode_attention
from arctic_fca.fca.decode import prepare_decode
from arctic_fca.fca.reference import gather_paged_kv, paged_decode_attention
from fca_common import (GPU_PREFIXES, GPU_SHAPES, GPU_SUFFIX, QWEN3_1_7B_HEADS, QWEN3_8B_HEADS, attention_args,
                        build_batch, copy_bandwidth_bytes_per_s, describe, layer_copies, max_abs_diff, parse_shapes,
                        per_layer_us, time_us, tuning_of)

# ----------------------------------------------------------------------------- CPU smoke

SMOKE_CASES = [  # (groups, samples, prefix, suffix, system)
    (1, 8, 64, 5, 0), (2, 4, 16, 1, 0), (3, 3, 32, 40, 32), (4, 1, 48, 17, 0), (2, 5, 16, 16, 16), (1, 2, 128, 33, 64),
]


def smoke() -> dict:
    max_diff, cases, ratios = 0.0, 0, {}
    for block_size in (16, 32):
        for i, (groups, samples, prefix, suffix, system) in enumerate(SMOKE_CASES):
            prefix, system = (math.ceil(n / block_size) * block_size for n in (prefix, system))
            for heads in (dict(num_q_heads=8, num_kv_heads=2, head_dim=64),
                          dict(num_q_heads=4, num_kv_heads=4, head_dim=32)):
                batch = build_batch(groups, samples, prefix, suffix, system=system, block_size=block_size, seed=i,
                                    **heads)
                info = describe(batch)
                fca = fca_decode_attention(*attention_args(batch), 0.125, plan=info["plan"])
                plain = paged_decode_attention(*attention_args(batch), 0.125)
                max_diff = max(max_diff, max_abs_diff(fca, plain))
                cases += 1
                ratios[f"{groups}x{samples} sys{system} p{prefix} s{suffix} b{block_size}"] = info["byte_ratio"]
    return {"max_abs_diff": max_diff, "cases": cases, "byte_ratio_plain_over_unique": ratios}


# ----------------------------------------------------------------------------- GPU timing


def gpu_case(groups: int, samples: int, prefix: int, copy_bw: float) -> dict:
    batch = build_batch(groups, samples, prefix, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **QWEN3_8B_HEADS)
    query, key_cache, value_cache, block_tables, seq_lens = attention_args(batch)
    scale = 1 / math.sqrt(QWEN3_8B_HEADS["head_dim"])
    info = describe(batch)
    tables_host, lens_host = block_tables.cpu(), seq_lens.cpu()
    shape = dict(num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2], head_dim=query.shape[2],
                 dtype=query.dtype, device="cuda")
    prepared, prepare_ms = {}, {}
    for mode in ("fca", "plain", "auto"):
        begin = time.perf_counter()  # host-side, once per step (shared by all layers)
        prepared[mode] = prepare_decode(tables_host, lens_host, key_cache.shape[1], mode=mode, **shape)
        torch.cuda.synchronize()
        prepare_ms[mode] = (time.perf_counter() - begin) * 1e3
    # Dense per-request KV for SDPA, gathered outside the timing: [requests, kv_heads, seq, head_dim].
    dense_k, dense_v = (gather_paged_kv(cache, block_tables, torch.zeros_like(lens_host), lens_host).transpose(1, 2)
                        .contiguous() for cache in (key_cache, value_cache))
    caches, dense = layer_copies(key_cache, value_cache), layer_copies(dense_k, dense_v)
    runs = {mode: (lambda layer=0, p=p: p(query, *caches[layer], scale)) for mode, p in prepared.items()}
    runs["sdpa"] = lambda layer=0: F.scaled_dot_product_attention(query[:, :, None], *dense[layer], scale=scale,
                                                                  enable_gqa=True)[:, :, 0]
    reference = runs["sdpa"]().float()
    torch_fca = lambda: fca_attention_with_lse(query, key_cache, value_cache, block_tables, scale, info["plan"])[0]  # noqa: E731
    max_diff = max(max_abs_diff(out, reference) for out in (runs["fca"](), runs["plain"](), torch_fca()))
    # An engine replays decode attention inside a CUDA graph, layer after layer: time it so.
    us = {name: per_layer_us(run) for name, run in runs.items()}
    us["torch_fca"] = time_us(torch_fca)  # eager, once
    estimate = info["bytes"]
    return {
        "groups": groups, "samples": samples, "prefix": prefix, "suffix": GPU_SUFFIX, "nodes": info["nodes"],
        "byte_ratio": info["byte_ratio"], "auto_choice": "fca" if prepared["auto"].uses_fca else "plain",
        "prepare_ms": {k: round(v, 2) for k, v in prepare_ms.items()},
        **{f"{name}_us": round(t, 1) for name, t in us.items()},
        "fca_speedup_vs_plain_kernel": round(us["plain"] / us["fca"], 2),
        "auto_speedup_vs_plain_kernel": round(us["plain"] / us["auto"], 2),
        "fca_speedup_vs_sdpa": round(us["sdpa"] / us["fca"], 2),
        # Decode attention reads each byte once: bandwidth on the unique KV bytes vs the copy's (read + write).
        "fca_unique_bw_fraction": round(estimate.unique_kv / (us["fca"] * 1e-6) / copy_bw, 3),
        "plain_bw_fraction": round(estimate.plain / (us["plain"] * 1e-6) / copy_bw, 3),
        "max_abs_diff_vs_sdpa": max_diff,
    }


def gpu() -> dict:
    results = []
    copy_bw = copy_bandwidth_bytes_per_s()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    for prefix in GPU_PREFIXES:
        for groups, samples in GPU_SHAPES:
            result = gpu_case(groups, samples, prefix, copy_bw)
            torch.cuda.empty_cache()  # the case's caches are gone with its frame: hand the memory back
            print(" ".join(f"{k}={v}" for k, v in result.items()), flush=True)
            results.append(result)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tb_s": round(copy_bw / 1e12, 3),
            "results": results}


def breakdown(shapes=((1, 64, 4096), (8, 16, 4096), (1, 64, 16384), (32, 8, 4096)), heads=QWEN3_8B_HEADS,
              tunings=({},), layouts=("token-major",)) -> dict:
    """Where an FCA step's time goes (``heads``: Qwen3-8B's by default): the node launch alone, the single-request
    launch alone, both side by side, the merge alone, and the whole step, each from a CUDA graph;
    with the unique-byte bandwidth of the whole step and the node launch's tensor-core rate; per
    FCA tuning of ``tunings`` (overrides of the defaults, ``{}``: the defaults) and cache layout of
    ``layouts``: "token-major" (``[blocks, block_size, kv_heads, head_dim]`` in memory, a token's
    heads side by side) or "head-major" (the same tensor stored ``[blocks, kv_heads, block_size,
    head_dim]``: a head's tokens of a block side by side)."""
    from arctic_fca.fca import triton_decode as td

    copy_bw = copy_bandwidth_bytes_per_s()
    scale = 1 / math.sqrt(heads["head_dim"])
    rows = []
    for (groups, samples, prefix), changes, layout in itertools.product(shapes, tunings, layouts):
        batch = build_batch(groups, samples, prefix, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **heads)
        query, key_cache, value_cache, block_tables, seq_lens = attention_args(batch)
        if layout == "head-major":
            key_cache, value_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (key_cache, value_cache))
        prepared = prepare_decode(block_tables.cpu(), seq_lens.cpu(), key_cache.shape[1], mode="fca",
                                  dtype=query.dtype, device="cuda", tuning=tuning_of(changes), **heads)
        work = prepared.work
        out = torch.empty_like(query)
        caches = layer_copies(key_cache, value_cache)

        def launch(which):
            return lambda layer: td._launch(getattr(work, which), work, query, *caches[layer], work.partial,
                                            work.lse, scale)

        runs = {"node": launch("node"), "single": launch("single"),
                "both": lambda layer: td._launch_partials(work, query, *caches[layer], scale),
                "merge": lambda layer: td._merge(work, out),
                "step": lambda layer: prepared(query, *caches[layer], scale)}
        us = {name: per_layer_us(run) for name, run in runs.items()}
        info = describe(batch)
        exact = fca_attention_with_lse(query, key_cache, value_cache, block_tables, scale, info["plan"])[0]
        node_items = int(work.node.count.item())
        # QK and PV over each request's shared tokens
        node_flops = 4 * heads["head_dim"] * heads["num_q_heads"] * samples * groups * prefix
        row = {"shape": f"{groups}x{samples}@{prefix}", "tuning": changes, "layout": layout, "node_items": node_items,
               "single_items": int(work.single.count.item()), "partial_rows": int(work.merge_rows.numel()),
               **{f"{k}_us": round(v, 1) for k, v in us.items()},
               "step_unique_bw": round(info["bytes"].unique_kv / (us["step"] * 1e-6) / copy_bw, 3),
               "node_tflops": round(node_flops / (us["node"] * 1e-6) / 1e12, 1),
               "max_abs_diff_vs_torch": max_abs_diff(runs["step"](0), exact)}
        print(row, flush=True)
        rows.append(row)
    return {"copy_tb_s": round(copy_bw / 1e12, 3), "breakdown": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU exactness check (< 1 min)")
    parser.add_argument("--breakdown", action="store_true", help="GPU: an FCA step's launches timed one by one")
    parser.add_argument("--shapes", type=parse_shapes,
                        help="G/S/P,...: groups/samples/prefix for --breakdown")
    parser.add_argument("--heads", choices=["qwen3-8b", "qwen3-1.7b"], default="qwen3-8b",
                        help="attention heads of --breakdown")
    parser.add_argument("--layouts", nargs="+", default=["token-major"], choices=["token-major", "head-major"],
                        help="KV cache layouts in memory for --breakdown")
    parser.add_argument("--tunings", type=json.loads, default=[{}],
                        help='JSON list of FCA Tuning overrides for --breakdown, e.g. [{}, {"node": {"num_warps": 8}}]')
    args = parser.parse_args()
    if args.smoke:
        print(json.dumps(smoke()))
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for the CPU exactness check")
    elif args.breakdown:
        heads = QWEN3_8B_HEADS if args.heads == "qwen3-8b" else QWEN3_1_7B_HEADS
        print(json.dumps(breakdown(*[args.shapes] if args.shapes else [], heads=heads, tunings=args.tunings,
                                   layouts=args.layouts)))
    else:
        print(json.dumps(gpu()))


if __name__ == "__main__":
    main()
