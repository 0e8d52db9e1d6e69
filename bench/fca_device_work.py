"""The vLLM path's FCA work, built on the device from the block tables (``DeviceWorkBuilder``), on
the GPU: its cost per step and the kernels over it, at bench/vllm_fca.py's shapes (Qwen3-1.7B heads).

    python3 bench/fca_device_work.py              # eager / graph-replayed / forest-reusing builds, and the kernels
    python3 bench/fca_device_work.py --plain-cost # what a step that shares nothing pays
    python3 bench/fca_device_work.py --profile    # the build's kernels by CUDA time
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from dataclasses import replace

import torch

from arctic_fca.fca.decode import prepare_decode
from arctic_fca.fca.device_work import DeviceWorkBuilder
from arctic_fca.fca.triton_decode import _launch, triton_decode_attention
from fca_common import QWEN3_1_7B_HEADS, VLLM_SHAPES, graphed, max_abs_diff, time_us, vllm_step


def profile_build(groups: int = 32, samples: int = 8, prefix: int = 7680, width: int = 512, top: int = 12) -> None:
    """The device work build's kernels, by CUDA time (eager: one kernel per op)."""
    query, key_cache, _, tables, lens = vllm_step(groups, samples, prefix, width)
    builder = DeviceWorkBuilder(1024, width, key_cache.shape[0], 16, kv_dtype=query.dtype, device="cuda",
                                graphs=False, **QWEN3_1_7B_HEADS)
    builder.build(tables, lens)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            builder.build(tables, lens)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60), flush=True)


def device_work(shapes=VLLM_SHAPES, width: int = 512) -> dict:
    """The vLLM path's per-step cost: ``DeviceWorkBuilder.build``, eager, replayed from a CUDA
    graph, and reusing the first build's forest (every ``REFRESH_BUILDS`` builds a full
    one, as in the engine) (host ms per call, us on the stream, host syncs counted by torch's
    sync debug mode), and the kernels over its items, against the host-built FCA and plain work,
    at the vLLM benchmark's shapes (Qwen3-1.7B heads, tables as wide as an 8192-token context)."""
    heads = QWEN3_1_7B_HEADS
    scale = 1 / math.sqrt(heads["head_dim"])
    rows = []
    for groups, samples, prefix in shapes:
        query, key_cache, value_cache, tables, lens = vllm_step(groups, samples, prefix, width)
        host_ms, build_us, first_ms, syncs, outs = {}, {}, {}, [], {}
        kept = None
        for kind in ("eager", "graph", "reuse"):
            key = "the same requests" if kind == "reuse" else None  # reuse: the forest of the first build
            begin = time.perf_counter()
            builder = DeviceWorkBuilder(1024, width, key_cache.shape[0], 16, kv_dtype=query.dtype, device="cuda",
                                        graphs=kind != "eager", **heads)
            try:
                builder.build(tables, lens, forest_key=key)  # a graph is captured here
            except Exception as error:  # noqa: BLE001 - the experiment must not stop the others
                print(f"{kind} build failed: {error!r}"[:300], flush=True)
                continue
            torch.cuda.synchronize()
            first_ms[kind] = round((time.perf_counter() - begin) * 1e3)
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                begin = time.perf_counter()
                for _ in range(10):
                    work = builder.build(tables, lens, forest_key=key)
                host_ms[kind] = round((time.perf_counter() - begin) / 10 * 1e3, 3)
            torch.cuda.set_sync_debug_mode(0)
            syncs += caught
            build_us[kind] = round(time_us(lambda b=builder, k=key: b.build(tables, lens, forest_key=k)), 1)
            outs[kind] = triton_decode_attention(query, key_cache, value_cache, work, scale)
            kept = (builder, work) if kind == "graph" else kept
        builder, work = kept
        for sync in syncs[:3]:
            print("host sync:", sync.filename, sync.lineno, str(sync.message)[:200], flush=True)
        shape = dict(dtype=query.dtype, device="cuda", **heads)
        host = {mode: prepare_decode(tables.cpu(), lens.cpu(), 16, mode=mode, **shape) for mode in ("fca", "plain")}
        runs = {"device_work": graphed(lambda: triton_decode_attention(query, key_cache, value_cache, work, scale))}
        sequential = replace(work, tuning=work.tuning.replace(overlap_launches=False))  # one launch after the other
        runs["sequential"] = graphed(lambda: triton_decode_attention(query, key_cache, value_cache, sequential, scale))
        for kind in ("node", "single"):  # each launch alone
            runs[kind] = graphed(lambda k=kind: _launch(getattr(work, k), work, query, key_cache,
                                                                      value_cache, work.partial, work.lse, scale))
        runs.update({f"host_{m}": graphed(lambda p=p: p(query, key_cache, value_cache, scale))
                     for m, p in host.items()})
        out = triton_decode_attention(query, key_cache, value_cache, work, scale).float()
        graph_equals_eager = bool(torch.equal(outs["graph"], outs["eager"]))
        reuse_equals_eager = bool(torch.equal(outs["reuse"], outs["eager"])) if "reuse" in outs else None
        expected = host["plain"](query, key_cache, value_cache, scale).float()
        rows.append({"shape": f"{groups}x{samples}@{prefix}", "used_fca": bool(builder.used_fca),
                     "host_syncs_per_build": len(syncs) / (10 * len(host_ms)), "build_host_ms": host_ms,
                     "build_us": build_us, "graph_equals_eager": graph_equals_eager,
                     "reuse_equals_eager": reuse_equals_eager,
                     "first_build_ms": first_ms,
                     **{f"{k}_us": round(time_us(v), 1) for k, v in runs.items()},
                     "max_abs_diff_vs_plain": max_abs_diff(out, expected)})
        print(rows[-1], flush=True)
    return {"device_work": rows}


def plain_cost(shape=(128, 1, 2048), width: int = 512) -> dict:
    """What FCA's engine pays per step where nothing is shared (the vLLM bench's 128 x 1 @ 2048,
    Qwen3-1.7B heads): the plain build (``shared=False``, replayed graph) as one Triton program
    and as torch ops; and per layer the attention over its work (the node
    launch runs empty) against the same work without a node launch and against the host-built
    plain work."""
    heads = QWEN3_1_7B_HEADS
    scale = 1 / math.sqrt(heads["head_dim"])
    query, key_cache, value_cache, tables, lens = vllm_step(*shape, width)
    builders = {name: DeviceWorkBuilder(1024, width, key_cache.shape[0], 16, kv_dtype=query.dtype, device="cuda",
                                        **options, **heads)
                for name, options in (("kernel", {"plain_kernel": True}), ("torch", {}))}
    works = {name: builder.build(tables, lens, shared=False) for name, builder in builders.items()}
    outs = {name: triton_decode_attention(query, key_cache, value_cache, work, scale) for name, work in works.items()}
    work = works["kernel"]
    host = prepare_decode(tables.cpu(), lens.cpu(), 16, mode="plain", dtype=query.dtype, device="cuda", **heads)
    runs = {"device_plain": lambda: triton_decode_attention(query, key_cache, value_cache, work, scale),
            "without_node_launch": lambda: triton_decode_attention(query, key_cache, value_cache,
                                                                   replace(work, node=None), scale),
            "host_plain": lambda: host(query, key_cache, value_cache, scale)}
    row = {"shape": "{}x{}@{}".format(*shape),
           **{f"{name}_build_us": round(time_us(lambda b=b: b.build(tables, lens, shared=False)), 1)
              for name, b in builders.items()},
           "kernel_equals_torch_build": bool(torch.equal(outs["kernel"], outs["torch"])),
           **{f"{k}_us": round(time_us(graphed(v)), 1) for k, v in runs.items()}}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain-cost", action="store_true", help="what a step that shares nothing pays")
    parser.add_argument("--profile", action="store_true", help="the device work build's kernels")
    args = parser.parse_args()
    if args.plain_cost:
        print(json.dumps(plain_cost()))
    elif args.profile:
        profile_build()
    else:
        print(json.dumps(device_work()))


if __name__ == "__main__":
    main()
