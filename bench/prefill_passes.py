"""Prefill pass times of the embedded engine alone, over repeated generate calls: a Qwen3-1.7B-shaped
random bf16 model, PROMPTS prompts of PROMPT_LEN random tokens, 8 samples each and 2 new tokens, so
a call is almost all prefill. Each pass is timed between two device synchronisations. The same
passes inside a TRL step are timed by ``TIME_PREFILL=1 python3 bench/trl_step.py``.

    python3 bench/prefill_passes.py --prompt-len 5434 --calls 8
    python3 bench/prefill_passes.py --vary-lengths --profile-call 3   # new prompt lengths at every call
    python3 bench/prefill_passes.py --vary-lengths --variants cudnn flash cudnn-one-at-a-time  # whole calls, A/B
    python3 bench/prefill_passes.py --check    # the prefill attention on cuDNN against fp32, then exit

``--variants`` times whole calls (passes not synchronised) of each variant in turn on the same
prompts: the prompt attention on cuDNN's kernels over padded lengths (``cudnn``, the default) or on
flash attention (``flash``); ``-one-at-a-time``: the host reads each pass's samples before queueing
the next (``overlap_steps`` off). The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from arctic_core.compiling import bucketed_length
from arctic_core.config import SamplingParams
from arctic_fca.engine import EmbeddedEngine, EngineOptions, attention
from shapes import QWEN3_1_7B, make_model


def time_prefill_passes(engine: EmbeddedEngine) -> list[tuple[float, float, float]]:
    """From now on each prefill pass of ``engine`` is timed between two device synchronisations; the
    list its seconds are appended to: (wall, the host's until the pass returned, the device's between
    CUDA events). A wall time well above the device's is the host's doing."""
    prefill, passes = engine.runner.prefill, []
    cuda = engine.runner.device.type == "cuda"

    def timed_prefill(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        begin = time.perf_counter()
        out = prefill(*args, **kwargs)
        host = time.perf_counter() - begin
        if cuda:
            end.record()
            torch.cuda.synchronize()
        device = start.elapsed_time(end) / 1e3 if cuda else 0.0
        passes.append((round(time.perf_counter() - begin, 3), round(host, 3), round(device, 3)))
        return out

    engine.runner.prefill = timed_prefill
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=5434, help="TRL's 4096-token prompts re-tokenized")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--calls", type=int, default=8, help="the first compiles kernels")
    parser.add_argument("--vary-lengths", action="store_true", help="each prompt a length of its own (+- 64 tokens)")
    parser.add_argument("--profile-call", type=int, default=-1, help="print that call's Python profile (cProfile)")
    parser.add_argument("--variants", nargs="+", default=[], help="time whole calls of these variants in turn")
    parser.add_argument("--check", action="store_true", help="the cuDNN prompt attention against fp32 SDPA")
    args = parser.parse_args()
    if args.check:
        return check_cudnn_prefill()
    folder = "/tmp/qwen3-1.7b-shape-arctic"
    make_model(folder, QWEN3_1_7B)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    engine = EmbeddedEngine(model, EngineOptions(gpu_memory_utilization=0.5, progress=False))
    if args.variants:
        return compare_variants(engine, args)
    passes = time_prefill_passes(engine)
    rng, calls = random.Random(0), []
    for call in range(args.calls):
        prompts = random_prompts(rng, args)
        passes.clear()
        profile = cProfile.Profile() if call == args.profile_call else None
        if profile is not None:
            profile.enable()
        begin = time.perf_counter()
        engine.generate(prompts, SamplingParams(n=8, max_tokens=2, seed=call))
        calls.append({"passes_s (wall, host, device)": list(passes), "call_s": round(time.perf_counter() - begin, 3)})
        if profile is not None:
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        print("call", call, calls[-1], flush=True)
    print(json.dumps({"prompt_len": args.prompt_len, "prompts": args.prompts, "calls": calls}))


def random_prompts(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    """``args.prompts`` prompts of random tokens, ``args.prompt_len`` long (+- 64 with ``--vary-lengths``)."""
    lengths = [args.prompt_len + (rng.randrange(-64, 65) if args.vary_lengths else 0) for _ in range(args.prompts)]
    return [[rng.randrange(3, 999) for _ in range(n)] for n in lengths]


def compare_variants(engine: EmbeddedEngine, args: argparse.Namespace) -> None:
    """Whole calls of each variant in turn (the first call of each compiles and plans), same prompts."""
    rng, seconds = random.Random(0), {v: [] for v in args.variants}
    for call in range(args.calls):
        prompts = random_prompts(rng, args)
        for variant in args.variants:
            attention.CUDNN_PREFILL = variant.startswith("cudnn")
            engine.options.overlap_steps = not variant.endswith("-one-at-a-time")
            torch.cuda.synchronize()
            begin = time.perf_counter()
            engine.generate(prompts, SamplingParams(n=8, max_tokens=2, seed=call))
            seconds[variant].append(round(time.perf_counter() - begin, 3))
        print("call", call, {v: s[-1] for v, s in seconds.items()}, flush=True)
    steady = {v: round(statistics.median(s[2:] or s), 3) for v, s in seconds.items()}
    print(json.dumps({"prompt_len": args.prompt_len, "prompts": args.prompts, "vary_lengths": args.vary_lengths,
                      "median_call_s_after_two": steady, "calls_s": seconds}))


def check_cudnn_prefill() -> None:
    """The prompt attention the engine runs on cuDNN (padded lengths, bf16) against fp32 SDPA on the
    unpadded tensors, at lengths on and off the padding grid, Qwen3-1.7B heads."""
    torch.manual_seed(0)
    for n in (1, 100, 1000, 2048, 2049, 5430):
        q = torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = attention.causal_attention(q, k, v, 128 ** -0.5, gqa=True)
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        attention.CUDNN_PREFILL = False
        flash = attention.causal_attention(q, k, v, 128 ** -0.5, gqa=True)
        attention.CUDNN_PREFILL = True
        print(f"n={n}: padded to {bucketed_length(n, attention.CUDNN_GRANULE)}, max abs error cuDNN "
              f"{(out.float() - reference).abs().max():.5f}, flash {(flash.float() - reference).abs().max():.5f}",
              flush=True)


if __name__ == "__main__":
    main()
