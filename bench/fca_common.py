"""What the FCA benchmarks share: GRPO-shaped paged decode batches, and GPU timing as an engine's
decode step runs the kernels (replayed from CUDA graphs, layer after layer, each layer's KV cold)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from arctic_fca.fca import build_plan, choose, estimate_bytes
from arctic_fca.fca.tuning import DEFAULT_TUNING, Tuning

QWEN3_8B_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
QWEN3_1_7B_HEADS = dict(num_q_heads=16, num_kv_heads=8, head_dim=128)
GPU_SHAPES = [(1, 64), (8, 16), (32, 8), (128, 1)]  # groups x samples
GPU_PREFIXES = [1024, 4096, 16384]
GPU_SUFFIX = 256
VLLM_SHAPES = ((4, 64, 1024), (64, 8, 2048), (16, 16, 4096), (32, 8, 7680))  # bench/vllm_fca.py's


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


def smoke_or_gpu(smoke_requested: bool, smoke: Callable[[], dict], script: str) -> bool:
    """A Triton bench's start: with ``--smoke``, print ``smoke()`` (its kernels on the CPU, under
    Triton's interpreter) and return True; else exit unless a CUDA device is here, and return False."""
    if smoke_requested:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1")
        print(json.dumps(smoke()))
        return True
    if not torch.cuda.is_available():
        sys.exit(f"{script} times GPU kernels: no CUDA device here (--smoke checks on the CPU)")
    return False


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """A ``--shapes`` argument "G/S/P,G/S/P,...": (groups, samples, prefix) per shape."""
    return [tuple(map(int, shape.split("/"))) for shape in text.split(",")]


def max_abs_diff(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest ``|out - expected|``, inf when either holds a NaN or an inf (never read as small)."""
    if not (torch.isfinite(out).all() and torch.isfinite(expected).all()):
        return math.inf
    return (out.float() - expected.float()).abs().max().item()


def attention_args(batch: dict) -> tuple:
    return tuple(batch[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))


def describe(batch: dict) -> dict:
    """The plan's shape and what it saves."""
    query, key_cache = batch["query"], batch["key_cache"]
    plan = build_plan(batch["block_tables"], batch["seq_lens"], key_cache.shape[1])
    heads = dict(num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2], head_dim=query.shape[2],
                 dtype=query.dtype)
    return {"plan": plan, "nodes": plan.num_nodes,
            "byte_ratio": round(plan.plain_kv_tokens() / plan.fca_kv_tokens(), 3),
            "choice": choose(plan, **heads), "bytes": estimate_bytes(plan, **heads)}



def tuning_of(changes: dict) -> Tuning:
    """The default tuning with ``changes`` (a launch's own settings as a dict: {"node": {"num_stages": 3}})."""
    launches = {name: dataclasses.replace(getattr(DEFAULT_TUNING, name), **changes[name])
                for name in ("node", "single") if name in changes}
    return DEFAULT_TUNING.replace(**{**changes, **launches})


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
    of one call would charge that call the graph's whole launch latency (docs/benchmarks.md, FCA
    decode kernels), which a step of many layers pays once."""
    replay = graphed(lambda: [fn(layer) for _ in range(rounds) for layer in range(layers)])
    return time_us(replay) / (layers * rounds)


def copy_bandwidth_bytes_per_s() -> float:
    """Device-to-device copy bandwidth, measured here (bytes read + written per second)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6)


def vllm_step(groups: int, samples: int, prefix: int, width: int) -> tuple:
    """A bf16 decode step with Qwen3-1.7B heads on the GPU, its block tables as wide as vLLM's
    (``width`` blocks): (query, key cache, value cache, tables, lengths)."""
    batch = build_batch(groups, samples, prefix, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **QWEN3_1_7B_HEADS)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    return query, key_cache, value_cache, torch.nn.functional.pad(tables, (0, width - tables.shape[1])), lens
