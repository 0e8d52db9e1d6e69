"""A decode step's matrix products at Qwen3-1.7B's shapes, bf16: cuBLAS (``F.linear``, what the
embedded engine's decoder runs above ``fused_linear.MAX_ROWS`` rows) against the decoder's split-K
Triton kernel for a few rows (``arctic_fca.engine.fused_linear``), alone and with programmatic
dependent launch; and cuBLAS through cuBLASLt (``torch.backends.cuda.preferred_blas_library("cublaslt")``).

Each product is timed as a decode step runs it: one CUDA graph calls it once per layer over 28
layers' own weights (nothing left in L2 from one call to the next), and the time per call is the
graph's time over 28. The gate/up product is timed as cuBLAS then the SiLU x up kernel, and as the
Triton kernel's gated form (one launch). --sweep also times a grid of tile settings (the six
fastest reported; --wide: narrower column tiles, warps and pipeline stages too, compiled first in
parallel processes). The chain: a layer's products and the small kernels between them, 28 layers, per layer: as the
decoder runs them for many rows (add + RMSNorm kernels, cuBLAS, the SiLU x up kernel) and for a
few (``fused_linear``: the norms, residual adds and SiLU x up folded into four products), the
latter with and without programmatic dependent launch. --fold-limits: what folding the two small
kernels left beside the products into them would have to beat (the rotary + QK-norm + cache-store
kernel after QKV, whose epilogue would need a whole head, 128 columns, per program; the LM head on
the Triton kernel against cuBLAS, for the draw's first stage in its epilogue).

--smoke (CPU, under TRITON_INTERPRET=1): the Triton kernel against F.linear in fp32.

The last line printed is a JSON object of all results.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from arctic_fca.engine.fused_linear import LinearConfig, Normed, fused_linear
from arctic_fca.engine.fused_ops import add_rms_norm, qk_rope_store, silu_and_mul
from arctic_fca.engine.kv_cache import PagedKVCache
from fca_common import copy_bandwidth_bytes_per_s, graphed, smoke_or_gpu, time_us

LAYERS = 28
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 2048, 16, 8, 128, 6144, 151936
# name: (output columns, depth)
PRODUCTS = {
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
SWEEP = [LinearConfig(block_n=bn, block_k=bk, split_k=s)
         for bn, bk, s in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8))]
# --wide: narrower tiles (more programs for the few-column products), warps and pipeline depth too
WIDE_SWEEP = [LinearConfig(block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=st)
              for bn, bk, s, w, st in itertools.product((16, 32, 64), (128, 256), (1, 2), (4, 8), (3, 4, 6))]


def cublas(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    product = F.linear(x, weight)
    return silu_and_mul(product, triton=True) if gated else product


def cublaslt(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """``cublas`` with torch's matrix products routed to cuBLASLt (its own kernel heuristics)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return cublas(x, weight, gated)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def scaled_randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 normal values over sqrt(the last dim): a weight whose products stay of unit scale."""
    return (torch.randn(*shape, generator=gen, device=gen.device) * shape[-1] ** -0.5).bfloat16()


def per_call_us(fn, weights: list[torch.Tensor]) -> float:
    replay = graphed(lambda: [fn(w) for w in weights])
    return time_us(replay, min_seconds=0.05) / len(weights)


def config_name(config: LinearConfig) -> str:
    return f"n{config.block_n}/k{config.block_k}/s{config.split_k}/w{config.num_warps}/st{config.num_stages}"


def _compile(jobs: list[tuple[str, int, LinearConfig]]) -> None:
    """Compile each (product, rows, config) once (a worker process: Triton's cache on disk is shared)."""
    for name, rows, config in jobs:
        n, k = PRODUCTS[name]
        x = torch.zeros(rows, k, device="cuda", dtype=torch.bfloat16)
        try:
            fused_linear(x, torch.zeros(n, k, device="cuda", dtype=torch.bfloat16), gated=name == "gate_up",
                         config=config)
        except OutOfResources:
            pass
    torch.cuda.synchronize()


def compile_in_parallel(sweep: list[LinearConfig], rows: list[int], workers: int = 12) -> None:
    """Triton compiles one kernel at a time per process; a wide sweep compiles in ``workers``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(name, r, config) for name in PRODUCTS for r in rows for config in sweep]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, [jobs[i::workers] for i in range(workers)]))


def time_product(name: str, weights: list[torch.Tensor], x: torch.Tensor, sweep: list[LinearConfig]) -> dict:
    gated = name == "gate_up"
    weight_bytes = weights[0].numel() * weights[0].element_size()
    result = {"cublas_us": per_call_us(lambda w: cublas(x, w, gated), weights),
              "cublaslt_us": per_call_us(lambda w: cublaslt(x, w, gated), weights),
              "triton_us": per_call_us(lambda w: fused_linear(x, w, gated=gated), weights)}
    if sweep:
        times = {}
        for config in sweep:
            try:
                fused_linear(x, weights[0], gated=gated, config=config)  # outside any capture: fit the stages
                torch.cuda.synchronize()
                times[config_name(config)] = per_call_us(
                    lambda w, c=config: fused_linear(x, w, gated=gated, config=c), weights)
            except OutOfResources:  # tiles x stages beyond the shared memory
                continue
            except Exception as exc:  # noqa: BLE001 (a setting the compiler or the capture refuses: report, go on)
                print(f"{name} {config_name(config)}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                times[config_name(config)] = float("inf")
        result["sweep_fastest"] = sorted(times.items(), key=lambda item: item[1])[:6]
    result["cublas_weight_tb_s"] = weight_bytes / result["cublas_us"] / 1e6
    return result


def chain_us(rows: int, device: str) -> dict:
    """A layer's products and small kernels over 28 layers (attention left out: the output
    product's input is cut from the QKV product's), microseconds per layer."""
    gen = torch.Generator(device=device).manual_seed(2)
    layers = [{name: scaled_randn(gen, n, k) for name, (n, k) in PRODUCTS.items()} for _ in range(LAYERS)]
    norm = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(rows, HIDDEN, generator=gen, device=device).bfloat16()

    def unfused(_pdl: bool) -> torch.Tensor:
        h, residual = hidden, None
        for layer in layers:
            x, residual = add_rms_norm(h, residual, norm, 1e-6, triton=True)
            attended = F.linear(x, layer["qkv"])[:, : HEADS * HEAD_DIM]
            x, residual = add_rms_norm(F.linear(attended, layer["o"]), residual, norm, 1e-6, triton=True)
            h = F.linear(cublas(x, layer["gate_up"], gated=True), layer["down"])
        return h

    def fused(pdl: bool) -> torch.Tensor:
        h = hidden
        normed = Normed.of(h, norm)
        for layer in layers:
            attended = fused_linear(normed, layer["qkv"], eps=1e-6, pdl=pdl)[:, : HEADS * HEAD_DIM]
            h, normed = fused_linear(attended, layer["o"], residual=h, next_norm=norm, pdl=pdl)
            act = fused_linear(normed, layer["gate_up"], eps=1e-6, gated=True, pdl=pdl)
            h, normed = fused_linear(act, layer["down"], residual=h, next_norm=norm, pdl=pdl)
        return h

    variants = {"unfused_cublas": (unfused, False), "fused": (fused, False), "fused_pdl": (fused, True)}
    return {name: time_us(graphed(lambda f=step, p=pdl: f(p))) / LAYERS for name, (step, pdl) in variants.items()}


# Tiles that give a program whole heads (HEAD_DIM columns), as a rotary + QK-norm epilogue needs.
WHOLE_HEAD_TILES = [LinearConfig(block_n=HEAD_DIM, block_k=bk, split_k=s)
                    for bk, s in itertools.product((128, 256), (1, 2, 4, 8))]


def fold_limits(rows: int, device: str) -> dict:
    """Microseconds: per layer, 28 layers' QKV products in one CUDA graph (programmatic dependent
    launch), alone with the tiles in use, followed by the rotary + QK-norm + cache-store kernel, and
    alone with whole-head tiles; and the LM head's product on cuBLAS and on the Triton kernel."""
    gen = torch.Generator(device=device).manual_seed(3)
    n, k = PRODUCTS["qkv"]
    weights = [scaled_randn(gen, n, k) for _ in range(LAYERS)]

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, device=device, dtype=torch.bfloat16)

    normed = Normed.of(scaled_randn(gen, rows, k), ones(k))
    blocks, page = 4 * rows, 16
    cache = PagedKVCache(LAYERS, blocks, page, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device(device))
    slots = torch.randperm(blocks * page, generator=gen, device=device)[:rows]
    positions = torch.arange(rows, device=device) + 1024
    cos, sin = (torch.rand(2048, HEAD_DIM, generator=gen, device=device) for _ in range(2))
    head_norm = ones(HEAD_DIM)

    def qkv_chain(config: LinearConfig | None = None, rope: bool = False):
        def run() -> None:
            for layer, weight in enumerate(weights):
                qkv = fused_linear(normed, weight, eps=1e-6, pdl=True, config=config)
                if rope:
                    qk_rope_store(qkv, (HEADS, KV_HEADS, HEAD_DIM), positions, cos, sin, head_norm, head_norm, 1e-6,
                                  cache, layer, slots, triton=True, pdl=True)
        return graphed(run)

    result = {"qkv_us": time_us(qkv_chain()) / LAYERS, "qkv_then_rope_us": time_us(qkv_chain(rope=True)) / LAYERS,
              "qkv_whole_head_tiles_us": {config_name(c): time_us(qkv_chain(c)) / LAYERS for c in WHOLE_HEAD_TILES}}
    weights.clear()  # the LM head's 622 MB next
    head, x = scaled_randn(gen, VOCAB, HIDDEN), scaled_randn(gen, rows, HIDDEN)
    result["lm_head_cublas_us"] = time_us(graphed(lambda: F.linear(x, head)))
    result["lm_head_triton_us"] = time_us(graphed(lambda: fused_linear(x, head)))
    return result


def check(rows: int, device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Each product on the Triton kernel against cuBLAS (gate/up: gated): largest difference over
    the largest value."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, (n, k) in PRODUCTS.items():
        x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
        expected = cublas(x, w, gated=name == "gate_up")
        got = fused_linear(x, w, gated=name == "gate_up")
        out[name] = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    return out


def smoke() -> dict:
    """fp32 on the CPU (Triton's interpreter), 5 rows: each product against ``F.linear``."""
    return check(5, "cpu", torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU exactness check (run with TRITON_INTERPRET=1)")
    parser.add_argument("--rows", type=json.loads, default=[16, 64, 128])
    parser.add_argument("--sweep", action="store_true", help="a grid of tile settings at each row count")
    parser.add_argument("--wide", action="store_true", help="with --sweep: also block_n 16, warps and stages")
    parser.add_argument("--no-chain", action="store_true", help="skip the chain of a layer's products")
    parser.add_argument("--fold-limits", action="store_true", help="only the small kernels a fold would remove")
    args = parser.parse_args()
    sweep = (WIDE_SWEEP if args.wide else SWEEP) if args.sweep else []
    if smoke_or_gpu(args.smoke, smoke, "decode_gemm.py"):
        return
    device = "cuda"
    results = {"copy_read_tb_s": copy_bandwidth_bytes_per_s() / 2e12, "check": {r: check(r, device) for r in args.rows}}
    if args.fold_limits:
        results |= {f"fold_limits@{rows}": fold_limits(rows, device) for rows in args.rows}
        print(json.dumps(results))
        return
    for rows in [] if args.no_chain else args.rows:
        results[f"chain@{rows}"] = chain_us(rows, device)
        print("chain", rows, results[f"chain@{rows}"], flush=True)
    if args.wide:
        compile_in_parallel(sweep, args.rows)
    gen = torch.Generator(device=device).manual_seed(1)
    for name, (n, k) in PRODUCTS.items():
        weights = [scaled_randn(gen, n, k) for _ in range(LAYERS)]
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen, device=device).bfloat16()
            results[f"{name}@{rows}"] = time_product(name, weights, x, sweep)
            print(name, rows, results[f"{name}@{rows}"], flush=True)
        del weights
    print(json.dumps(results))


if __name__ == "__main__":
    main()
