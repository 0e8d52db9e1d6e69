"""A decode step's matrix products at Qwen3-1.7B's shapes, bf16: cuBLAS (``F.linear``, what the
embedded engine's decoder runs) against a split-K Triton kernel written for a few rows
(``skinny_linear.py``), alone and with programmatic dependent launch; and cuBLAS through cuBLASLt
(``torch.backends.cuda.preferred_blas_library("cublaslt")``).

Each product is timed as a decode step runs it: one CUDA graph calls it once per layer over 28
layers' own weights (nothing left in L2 from one call to the next), and the time per call is the
graph's time over 28. The gate/up product is timed as cuBLAS then the SiLU x up kernel, and as the
Triton kernel's gated form (one launch). --sweep also times a grid of tile settings at 64 rows.
The chain: a layer's four products one after another, 28 layers, per layer.

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

from arctic_fca.engine.fused_ops import silu_and_mul
from fca_common import copy_bandwidth_bytes_per_s, graphed, smoke_or_gpu, time_us
from skinny_linear import LinearConfig, skinny_linear

LAYERS = 28
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2048, 16, 8, 128, 6144
# name: (output columns, depth)
PRODUCTS = {
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
SWEEP = [LinearConfig(block_n=bn, block_k=bk, split_k=s)
         for bn, bk, s in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8))]


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


def per_call_us(fn, weights: list[torch.Tensor]) -> float:
    replay = graphed(lambda: [fn(w) for w in weights])
    return time_us(replay, min_seconds=0.05) / len(weights)


def time_product(name: str, weights: list[torch.Tensor], x: torch.Tensor, sweep: bool) -> dict:
    gated = name == "gate_up"
    weight_bytes = weights[0].numel() * weights[0].element_size()
    result = {"cublas_us": per_call_us(lambda w: cublas(x, w, gated), weights),
              "cublaslt_us": per_call_us(lambda w: cublaslt(x, w, gated), weights),
              "triton_us": per_call_us(lambda w: skinny_linear(x, w, gated=gated), weights)}
    if sweep:
        times = {}
        for config in SWEEP:
            try:
                times[f"n{config.block_n}/k{config.block_k}/s{config.split_k}"] = per_call_us(
                    lambda w, c=config: skinny_linear(x, w, gated=gated, config=c), weights)
            except OutOfResources:  # tiles x stages beyond the shared memory
                continue
        result["sweep_best"] = min(times.items(), key=lambda item: item[1])
    result["cublas_weight_tb_s"] = weight_bytes / result["cublas_us"] / 1e6
    return result


def chain_us(rows: int, device: str) -> dict:
    """A layer's products one after another over 28 layers (attention and norms left out: each
    product's input is cut from the one before), microseconds per layer."""
    gen = torch.Generator(device=device).manual_seed(2)
    randn = lambda *shape: (torch.randn(*shape, generator=gen, device=device) * shape[-1] ** -0.5).bfloat16()
    layers = [{name: randn(n, k) for name, (n, k) in PRODUCTS.items()} for _ in range(LAYERS)]
    hidden = torch.randn(rows, HIDDEN, generator=gen, device=device).bfloat16()
    variants = {"cublas": cublas, "cublaslt": cublaslt, "triton": skinny_linear,
                "triton_pdl": lambda x, w, gated=False: skinny_linear(x, w, gated=gated, pdl=True),
                "triton_pdl_early": lambda x, w, gated=False: skinny_linear(x, w, gated=gated, pdl=True, early=True)}

    def step(linear):
        h = hidden
        for layer in layers:
            attended = linear(h, layer["qkv"])[:, : HEADS * HEAD_DIM]
            h = linear(linear(linear(attended, layer["o"]), layer["gate_up"], gated=True), layer["down"])
        return h

    return {name: time_us(graphed(lambda f=linear: step(f))) / LAYERS for name, linear in variants.items()}


def check(rows: int, device: str) -> dict:
    """bf16 results against cuBLAS: largest difference over the largest value."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, (n, k) in PRODUCTS.items():
        x = torch.randn(rows, k, generator=gen, device=device).bfloat16()
        w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16()
        expected = cublas(x, w, gated=name == "gate_up")
        got = skinny_linear(x, w, gated=name == "gate_up")
        out[name] = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    return out


def smoke() -> dict:
    """fp32 on the CPU (Triton's interpreter): rows, columns and depth off the tiles, with and
    without a bias, K unsplit and split in 2 and 3, the first weight block loaded early or not, each
    launch twice (the arrival counters reset)."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows, n, k in ((1, 40, 48), (5, 70, 300), (33, 130, 200)):
        x, weight, bias = (torch.randn(*shape, generator=gen) for shape in ((rows, k), (n, k), (n,)))
        weight /= k**0.5  # outputs of order one: the difference is the relative one
        for split, b, early, _ in itertools.product((1, 2, 3), (None, bias), (False, True), range(2)):
            config = LinearConfig(block_n=32, block_k=32, split_k=split)
            got = skinny_linear(x, weight, b, config=config, early=early)
            worst = max(worst, (got - F.linear(x, weight, b)).abs().max().item())
            even = weight[: n - n % 2]
            gated = (skinny_linear(x, even, gated=True, config=config, early=early)
                     - silu_and_mul(F.linear(x, even), triton=False))
            worst = max(worst, gated.abs().max().item())
    return {"max_abs_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU exactness check (run with TRITON_INTERPRET=1)")
    parser.add_argument("--rows", type=json.loads, default=[16, 64, 128])
    parser.add_argument("--sweep", action="store_true", help="a grid of tile settings at 64 rows")
    args = parser.parse_args()
    if smoke_or_gpu(args.smoke, smoke, "decode_gemm.py"):
        return
    device = "cuda"
    results = {"copy_read_tb_s": copy_bandwidth_bytes_per_s() / 2e12, "check": {r: check(r, device) for r in args.rows}}
    for rows in args.rows:
        results[f"chain@{rows}"] = chain_us(rows, device)
        print("chain", rows, results[f"chain@{rows}"], flush=True)
    gen = torch.Generator(device=device).manual_seed(1)
    for name, (n, k) in PRODUCTS.items():
        weights = [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16() for _ in range(LAYERS)]
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen, device=device).bfloat16()
            results[f"{name}@{rows}"] = time_product(name, weights, x, args.sweep and rows == 64)
            print(name, rows, results[f"{name}@{rows}"], flush=True)
        del weights
    print(json.dumps(results))


if __name__ == "__main__":
    main()
