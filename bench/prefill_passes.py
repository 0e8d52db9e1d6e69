"""Prefill pass times of the embedded engine alone, over repeated generate calls: a Qwen3-1.7B-shaped
random bf16 model, PROMPTS prompts of PROMPT_LEN random tokens, 8 samples each and 2 new tokens, so
a call is almost all prefill. Each pass is timed between two device synchronisations. The same
passes inside a TRL step are timed by ``TIME_PREFILL=1 python3 bench/trl_step.py``.

    python3 bench/prefill_passes.py --prompt-len 5434 --calls 8
    python3 bench/prefill_passes.py --vary-lengths --profile-call 3   # new prompt lengths at every call

The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time

import torch
from transformers import AutoModelForCausalLM

from arctic_core.config import SamplingParams
from arctic_fca.engine import EmbeddedEngine, EngineOptions
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
    args = parser.parse_args()
    folder = "/tmp/qwen3-1.7b-shape-arctic"
    make_model(folder, QWEN3_1_7B)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    engine = EmbeddedEngine(model, EngineOptions(gpu_memory_utilization=0.5, progress=False))
    passes = time_prefill_passes(engine)
    rng, calls = random.Random(0), []
    for call in range(args.calls):
        lengths = [args.prompt_len + (rng.randrange(-64, 65) if args.vary_lengths else 0) for _ in range(args.prompts)]
        prompts = [[rng.randrange(3, 999) for _ in range(n)] for n in lengths]
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


if __name__ == "__main__":
    main()
