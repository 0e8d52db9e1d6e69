"""Prefill pass times of the embedded engine alone, over repeated generate calls: a Qwen3-1.7B-shaped
random bf16 model, PROMPTS prompts of PROMPT_LEN random tokens, 8 samples each and 2 new tokens, so
a call is almost all prefill. Each pass is timed between two device synchronisations. The same
passes inside a TRL step are timed by ``TIME_PREFILL=1 python3 bench/trl_step.py``.

    python3 bench/prefill_passes.py --prompt-len 5434 --calls 8

The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import AutoModelForCausalLM

from arctic_core.config import SamplingParams
from arctic_fca.engine import EmbeddedEngine, EngineOptions
from shapes import QWEN3_1_7B, make_model


def time_prefill_passes(engine: EmbeddedEngine) -> list[float]:
    """From now on each prefill pass of ``engine`` is timed between two device synchronisations; the
    list its seconds are appended to."""
    prefill, passes = engine.runner.prefill, []
    synchronize = torch.cuda.synchronize if engine.runner.device.type == "cuda" else lambda: None

    def timed_prefill(*args, **kwargs):
        synchronize()
        begin = time.perf_counter()
        out = prefill(*args, **kwargs)
        synchronize()
        passes.append(round(time.perf_counter() - begin, 3))
        return out

    engine.runner.prefill = timed_prefill
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=5434, help="TRL's 4096-token prompts re-tokenized")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--calls", type=int, default=8, help="the first compiles kernels")
    args = parser.parse_args()
    folder = "/tmp/qwen3-1.7b-shape-arctic"
    make_model(folder, QWEN3_1_7B)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    engine = EmbeddedEngine(model, EngineOptions(gpu_memory_utilization=0.5, progress=False))
    passes = time_prefill_passes(engine)
    rng, calls = random.Random(0), []
    for call in range(args.calls):
        prompts = [[rng.randrange(3, 999) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        passes.clear()
        begin = time.perf_counter()
        engine.generate(prompts, SamplingParams(n=8, max_tokens=2, seed=call))
        calls.append({"passes_s": list(passes), "call_s": round(time.perf_counter() - begin, 3)})
        print("call", call, calls[-1], flush=True)
    print(json.dumps({"prompt_len": args.prompt_len, "prompts": args.prompts, "calls": calls}))


if __name__ == "__main__":
    main()
