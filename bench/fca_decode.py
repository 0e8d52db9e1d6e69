"""FCA decode attention against the plain computation: exactness (CPU, --smoke) and speed (GPU).

--smoke (CPU, < 1 min): GRPO-shaped paged batches (an optional system prompt shared by all,
a prompt per group, a suffix per sample; singletons; block sizes 16 and 32), FCA vs the plain
paged computation in fp32; prints the largest difference.

GPU (no flag): Qwen3-8B attention shape (32 q heads, 8 KV heads, head_dim 128, bf16, block 16),
groups x samples = 1x64, 8x16, 32x8, 128x1, prefix 1024 / 4096 / 16384, suffix 256. Times, in the
same process: the Triton FCA kernels, the same Triton kernel as a plain FlashDecoding-style paged
decode (every request reads its whole KV, split-K), the cost model's pick between them ("auto"),
and torch SDPA over KV already gathered per request, each replayed from a CUDA graph as an engine's
decode step runs them: layer after layer, each layer with KV of its own (``per_layer_us``); and the
exact torch FCA path, eagerly. Reports the bandwidth FCA achieves on the unique KV bytes against
the copy bandwidth measured in the process.

The last line printed is a JSON object of all results.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from arctic_fca.fca import build_plan, choose, estimate_bytes, fca_attention_with_lse, fca_decode_attention
from arctic_fca.fca.decode import prepare_decode
from arctic_fca.fca.reference import gather_paged_kv, paged_decode_attention

QWEN3_8B_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
GPU_SHAPES = [(1, 64), (8, 16), (32, 8), (128, 1)]  # groups x samples
GPU_PREFIXES = [1024, 4096, 16384]
GPU_SUFFIX = 256


def build_batch(groups: int, samples: int, prefix: int, suffix: int, *, system: int = 0, block_size: int = 16,
                num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu", seed: int = 0) -> dict:
    """groups x samples requests over a paged cache: a system prompt of `system` tokens shared by
    all, a prompt of `prefix` tokens per group, `suffix` own tokens per sample (>= 1: the current
    token). System and prompt are whole blocks (a real cache copies a partly filled prompt block
    per sample). Physical block ids are a random permutation, as after a while of serving."""
    assert system % block_size == 0 and prefix % block_size == 0 and suffix >= 1
    gen = torch.Generator().manual_seed(seed)
    requests = groups * samples
    system_blocks, prompt_blocks = system // block_size, prefix // block_size
    suffix_blocks = math.ceil(suffix / block_size)
    num_blocks = system_blocks + groups * prompt_blocks + requests * suffix_blocks
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    system_ids, prompt_ids, own_ids = ids.split([system_blocks, groups * prompt_blocks, requests * suffix_blocks])
    block_tables = torch.cat([
        system_ids.expand(requests, -1),
        prompt_ids.view(groups, prompt_blocks).repeat_interleave(samples, dim=0),
        own_ids.view(requests, suffix_blocks),
    ], dim=1)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)

    # Draw on the device: the 16k-prefix caches hold billions of values (minutes on a CPU).
    device_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=device_gen, device=device).to(dtype)

    return {
        "query": randn(requests, num_q_heads, head_dim),
        "key_cache": randn(*cache_shape),
        "value_cache": randn(*cache_shape),
        "block_tables": block_tables.to(device),
        "seq_lens": torch.full((requests,), system + prefix + suffix, dtype=torch.int32, device=device),
    }


def attention_args(batch: dict) -> tuple:
    return tuple(batch[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))


def describe(batch: dict) -> dict:
    """The plan's shape and what it saves."""
    query, key_cache = batch["query"], batch["key_cache"]
    plan = build_plan(batch["block_tables"], batch["seq_lens"], key_cache.shape[1])
    heads = dict(num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2], head_dim=query.shape[2], dtype=query.dtype)
    return {"plan": plan, "nodes": plan.num_nodes, "byte_ratio": round(plan.plain_kv_tokens() / plan.fca_kv_tokens(), 3),
            "choice": choose(plan, **heads), "bytes": estimate_bytes(plan, **heads)}


# ----------------------------------------------------------------------------- CPU smoke

SMOKE_CASES = [  # (groups, samples, prefix, suffix, system)
    (1, 8, 64, 5, 0), (2, 4, 16, 1, 0), (3, 3, 32, 40, 32), (4, 1, 48, 17, 0), (2, 5, 16, 16, 16), (1, 2, 128, 33, 64),
]


def smoke() -> dict:
    max_diff, cases, ratios = 0.0, 0, {}
    for block_size in (16, 32):
        for i, (groups, samples, prefix, suffix, system) in enumerate(SMOKE_CASES):
            prefix, system = (math.ceil(n / block_size) * block_size for n in (prefix, system))
            for heads in (dict(num_q_heads=8, num_kv_heads=2, head_dim=64), dict(num_q_heads=4, num_kv_heads=4, head_dim=32)):
                batch = build_batch(groups, samples, prefix, suffix, system=system, block_size=block_size, seed=i, **heads)
                info = describe(batch)
                fca = fca_decode_attention(*attention_args(batch), 0.125, plan=info["plan"])
                plain = paged_decode_attention(*attention_args(batch), 0.125)
                max_diff = max(max_diff, (fca - plain).abs().max().item())
                cases += 1
                ratios[f"{groups}x{samples} sys{system} p{prefix} s{suffix} b{block_size}"] = info["byte_ratio"]
    return {"max_abs_diff": max_diff, "cases": cases, "byte_ratio_plain_over_unique": ratios}


# ----------------------------------------------------------------------------- GPU timing


def time_us(fn, min_seconds: float = 0.2) -> float:
    """Median microseconds of `fn` on the current CUDA stream (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    iters = max(3, min(50, int(min_seconds / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graphed(fn):
    """``fn`` captured in a CUDA graph (after a warm-up call that compiles its kernels); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


TIMED_LAYERS = 3  # KV caches of their own, replayed in turn: no call finds its KV left in L2 by the last
TIMED_ROUNDS = 4  # passes over the layers in one graph: its launch latency is spread over 12 calls


def layer_copies(*tensors: torch.Tensor, layers: int = TIMED_LAYERS) -> list[tuple[torch.Tensor, ...]]:
    """``layers`` sets of the given tensors (the first the originals, then copies): one per layer."""
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(layers - 1)]


def per_layer_us(fn, layers: int = TIMED_LAYERS, rounds: int = TIMED_ROUNDS) -> float:
    """Microseconds per call of ``fn(layer)`` as an engine's decode step runs it: one CUDA graph
    calls it for each layer in turn (each layer reads KV of its own, so L2 carries nothing from
    one call to the next, as the weights in between would flush it), ``rounds`` times over. A graph
    of one call would charge that call the graph's whole launch latency (5-10 us on the H200),
    which a step of many layers pays once."""
    replay = graphed(lambda: [fn(layer) for _ in range(rounds) for layer in range(layers)])
    return time_us(replay) / (layers * rounds)


def copy_bandwidth_bytes_per_s() -> float:
    """Device-to-device copy bandwidth, measured here (bytes read + written per second)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6)


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
    max_diff = max((out.float() - reference).abs().max().item() for out in (runs["fca"](), runs["plain"](), torch_fca()))
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


SWEEP_SHAPES = [(32, 8, 4096), (8, 16, 16384), (1, 64, 4096), (128, 1, 4096)]
VLLM_SHAPES = ((4, 64, 1024), (64, 8, 2048), (16, 16, 4096), (32, 8, 7680))  # bench/vllm_fca.py's
QWEN3_1_7B_HEADS = dict(num_q_heads=16, num_kv_heads=8, head_dim=128)


COMBOS = [  # settings the single-knob sweep liked, together (--sweep --quick)
    ("nodes bn64 s4, singles bn64, 2 items/SM", {"node": {"block_n": 64, "num_warps": 4, "num_stages": 4},
                                                 "single": {"block_n": 64, "num_warps": 4, "num_stages": 2}, "items": 2}),
    ("nodes bn64 s4, singles bn64 w2 s3, 2 items/SM", {"node": {"block_n": 64, "num_warps": 4, "num_stages": 4},
                                                       "single": {"block_n": 64, "num_warps": 2, "num_stages": 3}, "items": 2}),
    ("nodes bn64 s4, singles bn64", {"node": {"block_n": 64, "num_warps": 4, "num_stages": 4},
                                     "single": {"block_n": 64, "num_warps": 4, "num_stages": 2}}),
]


def sweep(heads: dict, shapes, quick: bool = False, match: list[str] | None = None) -> dict:
    """Time FCA and plain over launch settings (one knob group at a time, the others at their
    defaults); prints one line per setting. Used to pick the defaults in triton_decode / work."""
    from arctic_fca.fca import triton_decode, work

    batches = [build_batch(g, s, p, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **heads) for g, s, p in shapes]
    scale = 1 / math.sqrt(heads["head_dim"])

    def measure() -> dict:
        times = {}
        for (g, s, p), batch in zip(shapes, batches, strict=True):
            query, key_cache, value_cache, block_tables, seq_lens = attention_args(batch)
            caches = layer_copies(key_cache, value_cache)
            for mode in ("fca", "plain"):
                prepared = prepare_decode(block_tables.cpu(), seq_lens.cpu(), key_cache.shape[1], mode=mode,
                                          num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2],
                                          head_dim=query.shape[2], dtype=query.dtype, device="cuda")
                run = functools.partial(lambda layer, p: p(query, *caches[layer], scale), p=prepared)
                times[f"{g}x{s}@{p} {mode}"] = round(per_layer_us(run), 1)
        return times

    defaults = (dict(triton_decode.NODE_CONFIG), dict(triton_decode.SINGLE_CONFIG), work.ITEMS_PER_SM,
                triton_decode.PROGRAMS_PER_SM, work.NODE_TILE_ROWS)
    settings = [("default", {}), ("default, sequential launches", {"sequential": True})] + COMBOS
    settings += [] if quick else [(f"node rows {rows}", {"rows": rows}) for rows in (16, 32, 128)]
    # Taller node tiles want more warps (a 128-row tile over 4 warps spills).
    settings += [] if quick else [(f"node rows 128 bn{bn} w8 s{st}", {"rows": 128, "node": {"block_n": bn, "num_warps": 8, "num_stages": st}})
                                  for bn, st in ((64, 2), (64, 3), (32, 4), (128, 2))]
    settings += [] if quick else [(f"node bn{bn} w{w} s{st}", {"node": {"block_n": bn, "num_warps": w, "num_stages": st}})
                 for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    # Deeper pipelines (more KV bytes in flight per SM; shared memory allows them at one program per SM).
    settings += [] if quick else [(f"node bn{bn} w4 s{st}", {"node": {"block_n": bn, "num_warps": 4, "num_stages": st}})
                                  for bn, st in ((64, 5), (64, 6), (32, 6), (32, 8))]
    settings += [] if quick else [(f"single bn{bn} w{w} s{st}", {"single": {"block_n": bn, "num_warps": w, "num_stages": st}})
                 for bn in (64, 128) for w in (2, 4) for st in (2, 3)]
    settings += [] if quick else [(f"items/SM {i} programs/SM {pr}", {"items": i, "programs": pr}) for i in (2, 4, 8, 16) for pr in (16, 32)]
    if match:
        settings = [(name, change) for name, change in settings if name == "default" or any(m in name for m in match)]
    results = {}
    for name, change in settings:
        triton_decode.NODE_CONFIG = change.get("node", defaults[0])
        triton_decode.SINGLE_CONFIG = change.get("single", defaults[1])
        work.ITEMS_PER_SM = change.get("items", defaults[2])
        triton_decode.PROGRAMS_PER_SM = change.get("programs", defaults[3])
        work.NODE_TILE_ROWS = change.get("rows", defaults[4])
        triton_decode.OVERLAP_LAUNCHES = not change.get("sequential", False)
        results[name] = measure()
        print(name, json.dumps(results[name]), flush=True)
    return results


def vllm_step(groups: int, samples: int, prefix: int, width: int) -> tuple:
    """A bf16 decode step with Qwen3-1.7B heads on the GPU, its block tables as wide as vLLM's
    (``width`` blocks): (query, key cache, value cache, tables, lengths)."""
    batch = build_batch(groups, samples, prefix, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **QWEN3_1_7B_HEADS)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    return query, key_cache, value_cache, torch.nn.functional.pad(tables, (0, width - tables.shape[1])), lens


def profile_build(groups: int = 32, samples: int = 8, prefix: int = 7680, width: int = 512, top: int = 12) -> None:
    """The device work build's kernels, by CUDA time (eager: one kernel per op)."""
    from arctic_fca.fca.device_work import DeviceWorkBuilder

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
    graph, compiled, and reusing the first build's forest (every ``REFRESH_BUILDS`` builds a full
    one, as in the engine) (host ms per call, us on the stream, host syncs counted by torch's sync debug mode), and the kernels over its items, against the
    host-built FCA and plain work, at the vLLM benchmark's shapes (Qwen3-1.7B heads, tables as wide as
    an 8192-token context)."""
    from arctic_fca.fca import triton_decode
    from arctic_fca.fca.device_work import DeviceWorkBuilder
    from arctic_fca.fca.triton_decode import triton_decode_attention

    heads = QWEN3_1_7B_HEADS
    scale = 1 / math.sqrt(heads["head_dim"])
    rows = []
    for groups, samples, prefix in shapes:
        query, key_cache, value_cache, tables, lens = vllm_step(groups, samples, prefix, width)
        host_ms, build_us, first_ms, syncs, outs = {}, {}, {}, [], {}
        kept, fell_back = None, None
        for kind in ("eager", "graph", "compiled", "reuse"):
            key = "the same requests" if kind == "reuse" else None  # reuse: the forest of the first build
            begin = time.perf_counter()
            builder = DeviceWorkBuilder(1024, width, key_cache.shape[0], 16, kv_dtype=query.dtype, device="cuda",
                                        graphs=kind != "eager", compile_backend="inductor" if kind == "compiled" else None,
                                        **heads)
            try:
                builder.build(tables, lens, forest_key=key)  # a graph is captured here (and the build compiled)
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
            if kind == "compiled":  # the builder falls back to unfused ops if inductor fails
                fell_back = builder._run_build == builder._build
        builder, work = kept
        for sync in syncs[:3]:
            print("host sync:", sync.filename, sync.lineno, str(sync.message)[:200], flush=True)
        shape = dict(dtype=query.dtype, device="cuda", **heads)
        host = {mode: prepare_decode(tables.cpu(), lens.cpu(), 16, mode=mode, **shape) for mode in ("fca", "plain")}
        runs = {"device_work": graphed(lambda: triton_decode_attention(query, key_cache, value_cache, work, scale))}
        triton_decode.OVERLAP_LAUNCHES = False  # the same, node and single launches one after the other
        runs["sequential"] = graphed(lambda: triton_decode_attention(query, key_cache, value_cache, work, scale))
        triton_decode.OVERLAP_LAUNCHES = True
        for kind in ("node", "single"):  # each launch alone
            runs[kind] = graphed(lambda k=kind: triton_decode._launch(getattr(work, k), work, query, key_cache,
                                                                      value_cache, work.partial, work.lse, scale))
        runs.update({f"host_{m}": graphed(lambda p=p: p(query, key_cache, value_cache, scale)) for m, p in host.items()})
        out = triton_decode_attention(query, key_cache, value_cache, work, scale).float()
        graph_equals_eager = bool(torch.equal(outs["graph"], outs["eager"]))
        compiled_equals_eager = bool(torch.equal(outs["compiled"], outs["eager"])) if "compiled" in outs else None
        reuse_equals_eager = bool(torch.equal(outs["reuse"], outs["eager"])) if "reuse" in outs else None
        expected = host["plain"](query, key_cache, value_cache, scale).float()
        rows.append({"shape": f"{groups}x{samples}@{prefix}", "used_fca": bool(builder.used_fca),
                     "host_syncs_per_build": len(syncs) / (10 * len(host_ms)), "build_host_ms": host_ms,
                     "build_us": build_us, "graph_equals_eager": graph_equals_eager,
                     "compiled_equals_eager": compiled_equals_eager, "reuse_equals_eager": reuse_equals_eager,
                     "compiled_fell_back": fell_back,
                     "first_build_ms": first_ms,
                     **{f"{k}_us": round(time_us(v), 1) for k, v in runs.items()},
                     "max_abs_diff_vs_plain": (out - expected).abs().max().item()})
        print(rows[-1], flush=True)
    return {"device_work": rows}


def plain_cost(shape=(128, 1, 2048), width: int = 512) -> dict:
    """What FCA's engine pays per step where nothing is shared (the vLLM bench's 128 x 1 @ 2048,
    Qwen3-1.7B heads): the plain build (``shared=False``, replayed graph) as one Triton program,
    as torch ops and as torch ops compiled; and per layer the attention over its work (the node
    launch runs empty) against the same work without a node launch and against the host-built
    plain work."""
    from dataclasses import replace

    from arctic_fca.fca.device_work import DeviceWorkBuilder
    from arctic_fca.fca.triton_decode import triton_decode_attention

    heads = QWEN3_1_7B_HEADS
    scale = 1 / math.sqrt(heads["head_dim"])
    query, key_cache, value_cache, tables, lens = vllm_step(*shape, width)
    builders = {name: DeviceWorkBuilder(1024, width, key_cache.shape[0], 16, kv_dtype=query.dtype, device="cuda",
                                        **options, **heads)
                for name, options in (("kernel", {"plain_kernel": True}), ("torch", {}),
                                      ("compiled", {"compile_backend": "inductor"}))}
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
           "kernel_equals_torch_build": all(torch.equal(outs["kernel"], outs[n]) for n in ("torch", "compiled")),
           **{f"{k}_us": round(time_us(graphed(v)), 1) for k, v in runs.items()}}
    print(row, flush=True)
    return row


def breakdown(shapes=((1, 64, 4096), (8, 16, 4096), (1, 64, 16384), (32, 8, 4096))) -> dict:
    """Where an FCA step's time goes (Qwen3-8B heads): the node launch alone, the single-request
    launch alone, both side by side, the merge alone, and the whole step, each from a CUDA graph;
    with the unique-byte bandwidth of the whole step and the node launch's tensor-core rate."""
    from arctic_fca.fca import triton_decode as td

    copy_bw = copy_bandwidth_bytes_per_s()
    scale = 1 / math.sqrt(QWEN3_8B_HEADS["head_dim"])
    rows = []
    for groups, samples, prefix in shapes:
        batch = build_batch(groups, samples, prefix, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **QWEN3_8B_HEADS)
        query, key_cache, value_cache, block_tables, seq_lens = attention_args(batch)
        prepared = prepare_decode(block_tables.cpu(), seq_lens.cpu(), key_cache.shape[1], mode="fca",
                                  dtype=query.dtype, device="cuda", **QWEN3_8B_HEADS)
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
        node_items = int(work.node.count.item())
        node_flops = 4 * 128 * 32 * samples * groups * prefix  # QK and PV over each request's shared tokens
        row = {"shape": f"{groups}x{samples}@{prefix}", "node_items": node_items,
               "single_items": int(work.single.count.item()), "partial_rows": int(work.merge_rows.numel()),
               **{f"{k}_us": round(v, 1) for k, v in us.items()},
               "step_unique_bw": round(info["bytes"].unique_kv / (us["step"] * 1e-6) / copy_bw, 3),
               "node_tflops": round(node_flops / (us["node"] * 1e-6) / 1e12, 1)}
        print(row, flush=True)
        rows.append(row)
    return {"copy_tb_s": round(copy_bw / 1e12, 3), "breakdown": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU exactness check (< 1 min)")
    parser.add_argument("--sweep", action="store_true", help="GPU: time the kernels over launch settings")
    parser.add_argument("--vllm-shapes", action="store_true",
                        help="with --sweep: Qwen3-1.7B heads at bench/vllm_fca.py's shapes (default: Qwen3-8B's)")
    parser.add_argument("--quick", action="store_true", help="with --sweep: the defaults and COMBOS only")
    parser.add_argument("--profile-build", action="store_true", help="GPU: the device work build's kernels")
    parser.add_argument("--device-work", action="store_true", help="GPU: the vLLM path's device-built work, timed")
    parser.add_argument("--plain-cost", action="store_true", help="GPU: what a step that shares nothing pays")
    parser.add_argument("--breakdown", action="store_true", help="GPU: an FCA step's launches timed one by one")
    parser.add_argument("--shapes", type=lambda s: [tuple(map(int, x.split("/"))) for x in s.split(",")],
                        help="G/S/P,...: groups/samples/prefix for --sweep or --breakdown")
    parser.add_argument("--match", type=lambda s: s.split(","), help="with --sweep: only settings naming one of these")
    args = parser.parse_args()
    if args.breakdown:
        print(json.dumps(breakdown(*[args.shapes] if args.shapes else [])))
    elif args.plain_cost:
        print(json.dumps(plain_cost()))
    elif args.device_work:
        print(json.dumps(device_work()))
    elif args.smoke:
        print(json.dumps(smoke()))
    elif args.sweep:
        heads, shapes = (QWEN3_1_7B_HEADS, VLLM_SHAPES) if args.vllm_shapes else (QWEN3_8B_HEADS, SWEEP_SHAPES)
        print(json.dumps(sweep(heads, args.shapes or shapes, args.quick, args.match)))
    elif args.profile_build:
        profile_build()
    elif torch.cuda.is_available():
        print(json.dumps(gpu()))
    else:
        sys.exit("no CUDA device: run with --smoke for the CPU exactness check")


if __name__ == "__main__":
    main()
