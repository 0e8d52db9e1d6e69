# A record, not maintained (last run at commit 681d194): decode-step weights prefetched into L2 one kernel ahead.
"""Does asking the GPU's L2 cache for the next kernel's weights shorten a decode step? Measured on
the H200: no (docs/benchmarks.md), so the engine does not prefetch; this script is the record.

The idea: a decode step at small batches is a chain of short memory-bound kernels, each paying a
fixed start and end cost; a prefetch issued before kernel k for the bytes kernel k+1 reads would
keep DRAM busy across the boundary, so that kernel k+1 starts on L2 hits. The prefetch kernels:
on sm_90 each program's first thread issues ``cp.async.bulk.prefetch.L2`` for its 64 KB chunks,
or (both forms are measured) every thread one ``prefetch.global.L2`` per 128-byte line. A
prefetch kernel lasts until its lines arrive, so on the compute stream it delays the kernel it
should overlap; ``SideStreamPrefetch`` issues them from a stream of their own.

The chain: a decode step's heavy kernels at Qwen3-1.7B's shapes over 28 layers (the fused QKV
product, the FCA attention of an 8 x 8 @ 2048 batch, the output product, gate/up with its SiLU x up
kernel, down; bf16, one CUDA graph), with and without a prefetch before each kernel of the weight
the kernel after it reads. Variants (per layer, microseconds): "none"; "next" (every product's
weight prefetched one kernel ahead, the output product's before the attention); "next-no-attention"
(the output product's weight not prefetched: the attention's KV stream would evict it); each with
the prefetch capped at ``--caps`` MB, in its bulk and per-line forms, from a side stream (and with
``--in-line`` also on the compute stream). Also the prefetch launch alone. Each variant's result is
compared with the plain chain's (a prefetch changes no value: the difference is 0).

GPU only. The last line printed is a JSON object of all results.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from arctic_fca.engine.fused_ops import silu_and_mul
from arctic_fca.fca.decode import prepare_decode
from decode_gemm import HEAD_DIM, HEADS, LAYERS, PRODUCTS
from fca_common import QWEN3_1_7B_HEADS, attention_args, build_batch, graphed, parse_shapes, time_us

LINE = 128  # bytes of an L2 line
BULK_CHUNK = 64 * 1024  # bytes per bulk prefetch instruction


@triton.jit
def _prefetch_bulk_kernel(ptr, n_bytes, CHUNK: tl.constexpr, CHUNKS_PER_PROGRAM: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (CHUNK * CHUNKS_PER_PROGRAM)
    for i in tl.static_range(CHUNKS_PER_PROGRAM):
        start = base + i * CHUNK
        size = tl.minimum(n_bytes - start, CHUNK).to(tl.int32)  # <= 0 past the end: skipped
        tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "setp.gt.and.s32 q, $2, 0, p; @q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + start, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_lines_kernel(ptr, n_bytes, LINES_PER_PROGRAM: tl.constexpr, LINE_BYTES: tl.constexpr):
    offsets = (tl.program_id(0).to(tl.int64) * LINES_PER_PROGRAM + tl.arange(0, LINES_PER_PROGRAM)) * LINE_BYTES
    inside = (offsets < n_bytes).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + offsets, inside], dtype=tl.int32, is_pure=False, pack=1)


class SideStreamPrefetch:
    """Prefetches on a stream of their own: a prefetch kernel lasts until its lines arrive (kernels
    retire only when their memory requests have), so on the compute stream it would delay the
    kernel it should overlap. ``ahead`` forks from the current stream at this point of its queue;
    ``join`` makes the current stream wait for all of them (before a graph capture ends)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.pending = False

    def ahead(self, tensor: torch.Tensor, max_bytes: int | None = None, **kwargs) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            prefetch_l2(tensor, max_bytes, **kwargs)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending = False


def prefetch_l2(tensor: torch.Tensor, max_bytes: int | None = None, *, bulk: bool, programs: int = 8) -> None:
    """Start fetching the first ``max_bytes`` (default: all) of the contiguous ``tensor`` into L2
    (``bulk``: the sm_90 bulk form, else one prefetch per line)."""
    assert tensor.is_contiguous(), "prefetch_l2 reads a contiguous tensor's bytes"
    n_bytes = tensor.numel() * tensor.element_size()
    if max_bytes is not None:
        n_bytes = min(n_bytes, max_bytes)
    data = tensor.view(torch.uint8).view(-1)
    if bulk:
        chunks = triton.cdiv(n_bytes, BULK_CHUNK)
        per_program = triton.cdiv(chunks, programs)
        _prefetch_bulk_kernel[(triton.cdiv(chunks, per_program),)](
            data, n_bytes, CHUNK=BULK_CHUNK, CHUNKS_PER_PROGRAM=per_program, num_warps=1)
    else:
        lines = triton.cdiv(n_bytes, LINE)
        per_program = max(128, triton.next_power_of_2(triton.cdiv(lines, programs)))
        _prefetch_lines_kernel[(triton.cdiv(lines, per_program),)](
            data, n_bytes, LINES_PER_PROGRAM=per_program, LINE_BYTES=LINE, num_warps=4)


MB = 1 << 20


def build_layers(groups: int, samples: int, prefix: int, suffix: int) -> tuple[list[dict], torch.Tensor, object]:
    """28 layers' weights and KV caches, the step's hidden rows and its prepared FCA attention."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    batch = build_batch(groups, samples, prefix, suffix, dtype=torch.bfloat16, device="cuda", **QWEN3_1_7B_HEADS)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    prepared = prepare_decode(tables.cpu(), lens.cpu(), key_cache.shape[1], mode="fca", dtype=torch.bfloat16,
                              device="cuda", **QWEN3_1_7B_HEADS)
    layers = []
    for index in range(LAYERS):
        layer = {name: (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
                 for name, (n, k) in PRODUCTS.items()}
        layer["kv"] = (key_cache, value_cache) if index == 0 else (key_cache.clone(), value_cache.clone())
        layers.append(layer)
    hidden = torch.randn(query.shape[0], PRODUCTS["qkv"][1], generator=gen, device="cuda").bfloat16()
    return layers, hidden, prepared


def step(layers: list[dict], hidden: torch.Tensor, prepared, prefetch: dict | None) -> torch.Tensor:
    """The chain; ``prefetch``: None, or {"cap": bytes, "bulk": bool, "across_attention": bool,
    "side": bool (from a side stream, else on the compute stream)}."""
    side = SideStreamPrefetch(hidden.device) if prefetch and prefetch.get("side") else None

    def ahead(weight: torch.Tensor) -> None:
        if side is not None:
            side.ahead(weight, prefetch["cap"], bulk=prefetch["bulk"])
        elif prefetch is not None:
            prefetch_l2(weight, prefetch["cap"], bulk=prefetch["bulk"])

    scale = HEAD_DIM**-0.5
    h = hidden
    for index, layer in enumerate(layers):
        following = layers[(index + 1) % len(layers)]
        if prefetch and prefetch["across_attention"]:
            ahead(layer["o"])
        qkv = F.linear(h, layer["qkv"])
        q = qkv[:, : HEADS * HEAD_DIM].view(qkv.shape[0], HEADS, HEAD_DIM)
        attended = prepared(q, *layer["kv"], scale)
        ahead(layer["gate_up"])
        x = F.linear(attended.flatten(1), layer["o"])
        ahead(layer["down"])
        x = silu_and_mul(F.linear(x, layer["gate_up"]), triton=True)
        ahead(following["qkv"])
        h = F.linear(x, layer["down"])
    if side is not None:
        side.join()
    return h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8/8/2048", help="groups/samples/prompt")
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--caps", type=json.loads, default=[32, 16, 8, 4], help="MB per prefetch (null: all)")
    parser.add_argument("--in-line", action="store_true", help="also prefetch on the compute stream itself")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("l2_prefetch.py times GPU kernels: no CUDA device here")
    groups, samples, prefix = parse_shapes(args.shape)[0]
    layers, hidden, prepared = build_layers(groups, samples, prefix, args.suffix)
    variants = {"none": None}
    sides = (True, False) if args.in_line else (True,)
    for cap, bulk, side, across in itertools.product(args.caps, (True, False), sides, (True, False)):
        label = (f"{'next' if across else 'next-no-attention'}/{'all' if cap is None else f'{cap}MB'}/"
                 f"{'bulk' if bulk else 'lines'}/{'side-stream' if side else 'in-line'}")
        variants[label] = {"cap": None if cap is None else cap * MB, "bulk": bulk, "across_attention": across,
                           "side": side}
    reference = step(layers, hidden, prepared, None)
    results = {"device": torch.cuda.get_device_name(), "shape": args.shape, "per_layer_us": {}}
    for name, setting in variants.items():
        diff = (step(layers, hidden, prepared, setting).float() - reference.float()).abs().max().item()
        us = time_us(graphed(lambda s=setting: step(layers, hidden, prepared, s))) / LAYERS
        results["per_layer_us"][name] = {"us": round(us, 2), "max_abs_diff_vs_none": diff}
        print(name, results["per_layer_us"][name], flush=True)
    for bulk in (True, False):
        for cap in (8, 32):
            replay = graphed(lambda b=bulk, c=cap: [prefetch_l2(layer["gate_up"], c * MB, bulk=b) for layer in layers])
            results[f"prefetch_alone/{cap}MB/{'bulk' if bulk else 'lines'}_us"] = round(time_us(replay) / LAYERS, 2)
    results["weights_mb_per_layer"] = round(sum(math.prod(s) for s in PRODUCTS.values()) * 2 / MB, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
