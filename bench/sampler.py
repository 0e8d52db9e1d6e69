"""GRPO-shaped rollouts on the embedded engine: FCA on, FCA off, and transformers ``generate``.

--smoke (CPU, tiny random Qwen3): the same rollout with FCA forced on, off and through
transformers; greedy outputs must agree token for token; prints timings.

GPU (no flag): a Qwen3-1.7B-shaped random bf16 model, 512 new tokens per sample (no stop token,
as vLLM's ``ignore_eos``), temperature 1: 64 prompts x 8 samples at prompt 2048, 16 x 16 at 4096,
32 x 8 at 7680. Generated tokens per second (wall clock, prefill included) with the cost model
choosing FCA per step ("auto"), with plain paged decode ("plain"), and, with --hf, transformers
``generate`` on the same prompts. vLLM's figures for the same shapes: bench/vllm_fca.py.

The last line printed is a JSON object of all results.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from arctic_core.config import SamplingParams
from arctic_core.hf import set_attention_implementation
from arctic_fca.engine import EmbeddedEngine, EngineOptions
from shapes import QWEN3_1_7B

SHAPES = [(64, 8, 2048), (16, 16, 4096), (32, 8, 7680)]  # prompts x samples @ prompt length
NEW_TOKENS = 512
NO_STOP = [10**9]


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def run_engine(engine: EmbeddedEngine, mode: str, prompts, params: SamplingParams) -> dict:
    engine.planner.mode = mode  # the cost model's choice per step, or FCA / plain throughout
    before = dataclasses.replace(engine.stats)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.tokens) for o in outputs)
    delta = {f.name: getattr(engine.stats, f.name) - getattr(before, f.name) for f in dataclasses.fields(before)}
    steps = max(1, delta["decode_steps"])
    return {"seconds": round(seconds, 2), "gen_tok_per_s": round(generated / seconds),
            "prefill_s": round(delta["prefill_seconds"], 2), "decode_step_ms": round(1e3 * delta["decode_seconds"] / steps, 2),
            "decode_host_prepare_ms": round(1e3 * delta["decode_prepare_seconds"] / steps, 2),
            "fca_step_fraction": round(delta["fca_steps"] / steps, 3), "tokens": [o.tokens for o in outputs]}


def run_hf(model, prompts, params: SamplingParams) -> dict:
    """transformers generate on the same prompts (all of equal length: no padding)."""
    ids = torch.tensor(prompts, device=model.device).repeat_interleave(params.n, 0)
    sampling = {} if params.greedy else {"do_sample": True, "temperature": params.temperature, "top_k": 0}
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=params.max_tokens, min_new_tokens=params.max_tokens, pad_token_id=0,
                         **(sampling or {"do_sample": False}))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out[:, ids.shape[1]:]
    return {"seconds": round(seconds, 2), "gen_tok_per_s": round(new.numel() / seconds), "tokens": new.tolist()}


def run_hf_batches(model, prompts, params: SamplingParams, per_batch: int, batches: int) -> dict:
    """``generate`` cannot hold a whole GRPO batch's duplicated KV (64 x 8 x 2.5k tokens is ~150 GB):
    run it as a user would, ``per_batch`` prompts at a time; time ``batches`` such batches (each
    batch runs at the same rate, so the rate of a few is the rate of all)."""
    seconds = tokens = 0
    for start in range(0, min(len(prompts), per_batch * batches), per_batch):
        result = run_hf(model, prompts[start : start + per_batch], params)
        seconds += result["seconds"]
        tokens += sum(map(len, result["tokens"]))
        torch.cuda.empty_cache()
    return {"seconds_timed": round(seconds, 2), "prompts_per_batch": per_batch, "gen_tok_per_s": round(tokens / seconds)}


def smoke() -> dict:
    from arctic_core.demo.task import CountingTask
    from arctic_core.demo.tiny_model import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(CountingTask().corpus())
    model = build_tiny_model(tokenizer, seed=0)
    reference = copy.deepcopy(model)
    engine = EmbeddedEngine(model, EngineOptions(kv_cache_tokens=8192))
    prompts = random_prompts(4, 40, len(tokenizer))
    params = SamplingParams(n=4, temperature=0, max_tokens=32, stop_token_ids=NO_STOP)
    results = {mode: run_engine(engine, mode, prompts, params) for mode in ("fca", "plain")}
    results["hf_generate"] = run_hf(reference, prompts, params)
    tokens = {name: r.pop("tokens") for name, r in results.items()}
    identical = tokens["fca"] == tokens["plain"] == tokens["hf_generate"]
    return {"greedy_identical": identical, **results}


def gpu(args) -> dict:
    config = AutoConfig.for_model("qwen3", **QWEN3_1_7B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf_model = None
    if args.hf:
        hf_model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16).cuda()
        hf_model.load_state_dict(model.state_dict())
    engine = EmbeddedEngine(model, EngineOptions(max_num_seqs=args.max_num_seqs, cuda_graphs=not args.eager,
                                                 gpu_memory_utilization=args.gpu_memory_utilization, progress=False))
    print(f"KV cache: {engine.pool.num_blocks * engine.options.block_size} tokens", flush=True)
    if hf_model is not None:  # the engine switched the shared config to its paged attention
        set_attention_implementation(hf_model, "sdpa")
    checks = graph_check(engine, config.vocab_size)
    print(json.dumps({"graph_check": checks}), flush=True)
    if args.profile:
        return profile(engine, args, config.vocab_size)
    results = []
    for prompts_count, samples, length in args.shapes:
        prompts = random_prompts(prompts_count, length, config.vocab_size)
        params = SamplingParams(n=samples, temperature=1.0, max_tokens=args.new_tokens, stop_token_ids=NO_STOP, seed=0)
        row = {"prompts": prompts_count, "samples": samples, "prompt_len": length, "new_tokens": args.new_tokens}
        for mode in args.modes:
            result = run_engine(engine, mode, prompts, params)
            result.pop("tokens")
            row[mode] = result
        if hf_model is not None:
            row["hf_generate"] = run_hf_batches(hf_model, prompts, params, args.hf_prompts_per_batch, args.hf_batches)
        print(json.dumps(row), flush=True)
        results.append(row)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}


def graph_check(engine: EmbeddedEngine, vocab: int) -> dict:
    """Greedy tokens with CUDA graphs equal those of eager decode, per mode (same kernels); this
    also compiles the kernels and captures the graphs before any timing."""
    prompts = random_prompts(4, 300, vocab, seed=1)
    params = SamplingParams(n=4, temperature=0, max_tokens=48, stop_token_ids=NO_STOP)
    graphs, identical = engine.runner.graphs, {}
    for mode in ("fca", "plain"):
        with_graphs = run_engine(engine, mode, prompts, params)["tokens"]
        engine.runner.graphs = None  # the same padded steps, run eagerly
        eager = run_engine(engine, mode, prompts, params)["tokens"]
        engine.runner.graphs = graphs
        identical[mode] = with_graphs == eager
    return identical


def profile(engine: EmbeddedEngine, args, vocab: int) -> dict:
    """Where a decode step's time goes: device kernels and host time over a short rollout per mode."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prompts_count, samples, length = args.shapes[0]
    prompts = random_prompts(prompts_count, length, vocab)
    params = SamplingParams(n=samples, max_tokens=24, stop_token_ids=NO_STOP, seed=0)
    summary = {}
    for mode in args.modes:
        run_engine(engine, mode, prompts, params)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = run_engine(engine, mode, prompts, params)
        print(f"== {mode}: {result['seconds']} s for {params.max_tokens} tokens per sample", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)
        summary[mode] = result["seconds"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU agreement check (tiny model)")
    parser.add_argument("--hf", action="store_true", help="also time transformers generate")
    parser.add_argument("--hf-prompts-per-batch", type=int, default=8)
    parser.add_argument("--hf-batches", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["auto", "plain"], choices=["auto", "fca", "plain"])
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="profile a short rollout of the first shape per mode")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--shapes", type=json.loads, default=SHAPES, help="JSON [[prompts, samples, prompt_len], ...]")
    args = parser.parse_args()
    if args.smoke:
        print(json.dumps(smoke()))
    elif torch.cuda.is_available():
        print(json.dumps(gpu(args)))
    else:
        sys.exit("no CUDA device: run with --smoke for the CPU check")


if __name__ == "__main__":
    main()
