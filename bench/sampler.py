"""GRPO-shaped rollouts on the embedded engine: FCA on, FCA off, and transformers ``generate``.

--smoke (tiny random fp32 Qwen3, on the GPU when there is one): the same rollout with FCA forced
on, off and through transformers; greedy outputs must agree token for token; prints timings.

GPU (no flag): a Qwen3-1.7B-shaped random bf16 model, 512 new tokens per sample (no stop token, as
vLLM's ``ignore_eos``), temperature 1 (--filters: with top-k, top-p or min-p), at the GRPO shapes of
``SHAPES``. Generated tokens per second (wall clock, prefill included) with the cost model choosing
FCA per step ("auto"), with plain paged decode ("plain"), and, with --hf, transformers ``generate``
on the same prompts; per decoder (--decoders: the engine's fused decoder, the same with its few-row
products on cuBLAS and the small kernels or without programmatic dependent launch, transformers'
modules); --compare-flipped also runs with engine options flipped (queued decode steps, prefill
chunks mixed with decode, blocks reserved for max_tokens instead of lent on demand), and --stop-ids
makes samples end at varied lengths, so groups are admitted while others decode (with a
--max-num-seqs below the batch), as in RL rollouts. Each decode step's time is reported against its bytes
floor: the weights plus the KV the step must read at least (each prompt once, each sample's own
tokens), at the device-to-device copy rate measured in the same run.
vLLM's figures for the same shapes: bench/vllm_fca.py.

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
from arctic_fca.engine import EmbeddedEngine, EngineOptions, fused_linear
from arctic_fca.fca.tuning import Tuning
from fca_common import tuning_of
from shapes import QWEN3_1_7B

# prompts x samples @ prompt length
SHAPES = [(8, 8, 2048), (8, 8, 4096), (64, 8, 2048), (16, 16, 4096), (32, 8, 7680), (128, 1, 2048)]
NEW_TOKENS = 512


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def run_engine(engine: EmbeddedEngine, mode: str, prompts, params: SamplingParams) -> dict:
    engine.planner.mode = mode  # the cost model's choice per step, or FCA / plain throughout
    engine.stats.most_running = 0  # this rollout's
    engine.pool.clear_index()  # nothing found from an earlier rollout, as after an RL step's weight update
    before = dataclasses.replace(engine.stats)
    graphs = engine.runner.graphs
    graphs_before, misfits_before = (len(graphs.graphs), graphs.misfits) if graphs is not None else (0, 0)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.tokens) for o in outputs)
    delta = {f.name: getattr(engine.stats, f.name) - getattr(before, f.name) for f in dataclasses.fields(before)}
    steps = max(1, delta["decode_steps"])
    return {"seconds": round(seconds, 2), "gen_tok_per_s": round(generated / seconds),
            "prefill_s": round(delta["prefill_seconds"], 2),
            "decode_step_ms": round(1e3 * delta["decode_seconds"] / steps, 2),
            "decode_host_prepare_ms": round(1e3 * delta["decode_prepare_seconds"] / steps, 2),
            "fca_step_fraction": round(delta["fca_steps"] / steps, 3), "prefill_steps": delta["prefill_steps"],
            "mixed_steps": delta["mixed_steps"], "decode_steps": delta["decode_steps"],
            "mean_new_tokens": round(generated / len(outputs), 1), "most_running": engine.stats.most_running,
            "preempted": delta["preempted"],
            "graphs_captured": (len(graphs.graphs) if graphs is not None else 0) - graphs_before,
            "eager_steps": (graphs.misfits - misfits_before) if graphs is not None else 0,
            "tokens": [o.tokens for o in outputs]}


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
    return {"seconds_timed": round(seconds, 2), "prompts_per_batch": per_batch,
            "gen_tok_per_s": round(tokens / seconds)}


def smoke(device: str) -> dict:
    """Greedy agreement on a tiny fp32 model: FCA, plain decode and transformers generate, with
    groups admitted two at a time and prefill chunks of 48 tokens mixed with their decode."""
    from arctic_core.demo.task import CountingTask
    from arctic_core.demo.tiny_model import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(CountingTask().corpus())
    model = build_tiny_model(tokenizer, seed=0).to(device)
    reference = copy.deepcopy(model)
    engine = EmbeddedEngine(model, EngineOptions(kv_cache_tokens=8192, max_num_seqs=8, max_prefill_tokens=48,
                                                 chunked_prefill=True))
    prompts = random_prompts(4, 40, len(tokenizer))
    params = SamplingParams(n=4, temperature=0, max_tokens=32, ignore_eos=True)
    results = {mode: run_engine(engine, mode, prompts, params) for mode in ("fca", "plain")}
    results["hf_generate"] = run_hf(reference, prompts, params)
    tokens = {name: r.pop("tokens") for name, r in results.items()}
    identical = tokens["fca"] == tokens["plain"] == tokens["hf_generate"]
    return {"device": device, "greedy_identical": identical, **results}


def gpu(args) -> dict:
    config = AutoConfig.for_model("qwen3", **QWEN3_1_7B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf_model = None
    if args.hf:
        hf_model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16).cuda()
        hf_model.load_state_dict(model.state_dict())
    fp32 = None if args.skip_checks else fp32_greedy(model, config.vocab_size)  # before the engine takes the memory
    engine = EmbeddedEngine(model, EngineOptions(max_num_seqs=args.max_num_seqs, cuda_graphs=not args.eager,
                                                 max_prefill_tokens=args.max_prefill_tokens,
                                                 chunked_prefill=args.chunked_prefill,
                                                 gpu_memory_utilization=args.gpu_memory_utilization, progress=False))
    print(f"KV cache: {engine.pool.num_blocks * engine.options.block_size} tokens", flush=True)
    if hf_model is not None:  # the engine switched the shared config to its paged attention
        set_attention_implementation(hf_model, "sdpa")
    decoders = Decoders(engine)
    checks = {}
    if not args.skip_checks:
        for name in args.decoders:
            decoders.use(name)
            checks[f"{name}_graphs_equal_eager"] = graph_check(engine, config.vocab_size)
        checks["fused_vs_transformers"] = decoder_check(engine, decoders, config.vocab_size, fp32)
    print(json.dumps({"greedy_checks": checks}), flush=True)
    if args.profile:
        decoders.use(args.decoders[0])  # the checks left the last decoder they compared in place
        return profile(engine, args, config.vocab_size)
    copy_rate = device_copy_rate()
    results = []
    for prompts_count, samples, length in args.shapes:
        prompts = random_prompts(prompts_count, length, config.vocab_size)
        stops = random_prompts(1, args.stop_ids, config.vocab_size, seed=9)[0] if args.stop_ids else []
        params = SamplingParams(n=samples, temperature=1.0, max_tokens=args.new_tokens, stop_token_ids=stops,
                                ignore_eos=True, seed=0, **args.filters)
        row = {"prompts": prompts_count, "samples": samples, "prompt_len": length, "new_tokens": args.new_tokens,
               "decode_floor_ms": round(1e3 * step_bytes(model, prompts_count, samples, length, args.new_tokens)
                                        / copy_rate, 2)}
        first_tokens = None
        for tuning in args.tunings:  # FCA kernel settings to compare ({}: the defaults)
            use_tuning(engine, tuning_of(tuning))
            suffix = f" {json.dumps(tuning)}" if tuning else ""
            timed, tokens = time_decoders(engine, decoders, prompts, params, args)
            row.update({key + suffix: value for key, value in timed.items()})
            first_tokens = first_tokens or tokens
            if len(args.tunings) > 1:  # one seeded rollout: settings that only launch differently keep its tokens
                row["tokens_as_first_tuning" + suffix] = tokens == first_tokens
        if hf_model is not None:
            row["hf_generate"] = run_hf_batches(hf_model, prompts, params, args.hf_prompts_per_batch, args.hf_batches)
        print(json.dumps(row), flush=True)
        results.append(row)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}


def time_decoders(engine: EmbeddedEngine, decoders: Decoders, prompts, params: SamplingParams,
                  args) -> tuple[dict, dict]:
    """One rollout per decoder and mode (and one with each engine option of --compare-flipped
    flipped): the timings, and each rollout's tokens."""
    row, tokens = {}, {}
    for name in args.decoders:
        decoders.use(name)
        for mode in args.modes:
            # Captures this batch's graph. A whole untimed rollout first when comparing, so that no
            # variant pays for compiling kernels or capturing graphs the others then reuse, and when
            # samples stop early: the batch then shrinks through bucket after bucket, each a graph to
            # capture, and the seeded rollout repeats the same steps when timed.
            whole = args.compare_flipped or params.stop_token_ids
            warmup = params if whole else params.model_copy(update={"max_tokens": 4})
            run_engine(engine, mode, prompts, warmup)
            for option in (None, *args.compare_flipped):
                flipped = flip(engine, option) if option else None
                result = run_engine(engine, mode, prompts, params)
                if option:
                    flip(engine, option)  # back
                key = f"{name}/{mode}" + (f"/{option}={flipped}" if option else "")
                tokens[key] = result.pop("tokens")
                row[key] = result
    return row, tokens


def flip(engine: EmbeddedEngine, option: str) -> str:
    """Flip an engine option; the new setting, in words."""
    if option == "admission":
        setting = {"on_demand": "worst_case", "worst_case": "on_demand"}[engine.options.admission]
        engine.options.admission = engine.scheduler.admission = setting
        return setting
    setattr(engine.options, option, not getattr(engine.options, option))
    return "on" if getattr(engine.options, option) else "off"


def use_tuning(engine: EmbeddedEngine, tuning: Tuning) -> None:
    """Switch the FCA kernels' split and launch settings (the graphs captured with others go)."""
    engine.planner.tuning = engine.runner.tuning = tuning
    if engine.runner.graphs is not None:
        engine.runner.graphs.tuning = tuning
        engine.runner.graphs.clear()


class Decoders:
    """Switches one engine between its fused decoder and transformers' modules (same weights)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.fused = engine, engine.runner.decoder
        self.pdl = self.fused.pdl  # the device's default

    def use(self, name: str) -> None:
        """The engine's decoder ("fused"; "fused-cublas": its few-row products on cuBLAS and the small
        kernels; "fused-no-pdl": without programmatic dependent launch) or transformers' modules."""
        fused = name.startswith("fused")
        self.engine.runner.decoder = self.fused if fused else None
        if fused:
            self.fused.fused_product_rows = 0 if name == "fused-cublas" else fused_linear.MAX_ROWS
            self.fused.pdl = self.pdl and name != "fused-no-pdl"
        if self.engine.runner.graphs is not None:
            self.engine.runner.graphs.clear()  # they captured the other forward


CHECK_PROMPTS, CHECK_PARAMS = (16, 300, 2), SamplingParams(n=4, temperature=0, max_tokens=64, ignore_eos=True)


def fp32_greedy(model, vocab: int) -> dict:
    """Greedy tokens of an fp32 copy of ``model`` through both decoders (they must be identical: the
    same math, only summation orders differ); the fused decoder's tokens are the reference for bf16."""
    model32 = copy.deepcopy(model).float()
    engine = EmbeddedEngine(model32, EngineOptions(kv_cache_tokens=1 << 15, progress=False))
    decoders, prompts, tokens = Decoders(engine), random_prompts(*CHECK_PROMPTS[:2], vocab, seed=CHECK_PROMPTS[2]), {}
    for name in ("fused", "transformers"):
        decoders.use(name)
        tokens[name] = run_engine(engine, "auto", prompts, CHECK_PARAMS)["tokens"]
    del engine, model32, decoders
    torch.cuda.empty_cache()
    return tokens


def agreeing_prefix(runs: list, reference: list) -> float:
    """Mean share of each sequence's tokens before its first difference from the reference."""
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) / len(a)
              for a, b in zip(runs, reference, strict=True)]
    return round(sum(prefix) / len(prefix), 3)


def decoder_check(engine: EmbeddedEngine, decoders: Decoders, vocab: int, fp32: dict) -> dict:
    """fp32: both decoders' greedy tokens identical. bf16: each decoder's agreement with the fp32
    tokens (rounding parts them at near-ties; the fused decoder should agree as well as
    transformers' modules do)."""
    prompts = random_prompts(*CHECK_PROMPTS[:2], vocab, seed=CHECK_PROMPTS[2])
    result = {"fp32_identical": fp32["fused"] == fp32["transformers"]}
    for name in ("fused", "transformers"):
        decoders.use(name)
        tokens = run_engine(engine, "auto", prompts, CHECK_PARAMS)["tokens"]
        result[f"bf16_{name}_agreeing_prefix_with_fp32"] = agreeing_prefix(tokens, fp32["fused"])
    return result


def device_copy_rate() -> float:
    """Bytes per second of a large device-to-device copy (read + write counted once each)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (time.perf_counter() - start)


def step_bytes(model, prompts: int, samples: int, prompt_len: int, new_tokens: int) -> float:
    """What a decode step must read at least, averaged over the rollout: every weight once and the
    KV of each prompt once plus each sample's own tokens (half the new tokens on average)."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * model.dtype.itemsize
    return weights + per_token * (prompts * prompt_len + prompts * samples * new_tokens / 2)


def graph_check(engine: EmbeddedEngine, vocab: int) -> dict:
    """Tokens with CUDA graphs equal those of eager decode, per mode (same kernels): greedy, and
    sampled with stop tokens, so that samples leave the batch at every length (its tables, tree and
    graph bucket change as they go); this also compiles the kernels and captures the graphs before
    any timing."""
    prompts = random_prompts(4, 300, vocab, seed=1)
    greedy = SamplingParams(n=4, temperature=0, max_tokens=48, ignore_eos=True)
    stops = random_prompts(1, vocab // 64, vocab, seed=9)[0]  # ~64 tokens per sample when logits are flat
    stopping = SamplingParams(n=4, temperature=1.0, max_tokens=96, stop_token_ids=stops, ignore_eos=True, seed=0)
    graphs, identical = engine.runner.graphs, {}
    for mode in ("fca", "plain"):
        for name, params in ((mode, greedy), (f"{mode}_stopping", stopping)):
            with_graphs = run_engine(engine, mode, prompts, params)["tokens"]
            engine.runner.graphs = None  # the same padded steps, run eagerly
            eager = run_engine(engine, mode, prompts, params)["tokens"]
            engine.runner.graphs = graphs
            identical[name] = with_graphs == eager
    return identical


def profile(engine: EmbeddedEngine, args, vocab: int) -> dict:
    """Where a decode step's time goes: device kernels and host time over a short rollout per mode."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prompts_count, samples, length = args.shapes[0]
    prompts = random_prompts(prompts_count, length, vocab)
    params = SamplingParams(n=samples, max_tokens=24, ignore_eos=True, seed=0)
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
    parser.add_argument("--smoke", action="store_true", help="greedy agreement check on a tiny model (CPU or GPU)")
    parser.add_argument("--hf", action="store_true", help="also time transformers generate")
    parser.add_argument("--hf-prompts-per-batch", type=int, default=8)
    parser.add_argument("--hf-batches", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["auto"], choices=["auto", "fca", "plain"])
    parser.add_argument("--decoders", nargs="+", default=["fused", "transformers"],
                        choices=["fused", "fused-cublas", "fused-no-pdl", "transformers"])
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--chunked-prefill", action="store_true", help="the engine's chunked_prefill option on")
    parser.add_argument("--compare-flipped", nargs="+", default=[],
                        choices=["overlap_steps", "chunked_prefill", "admission"],
                        help="also run with each of these engine options flipped (overlap_steps off: the host reads "
                        "each step's tokens before the next; chunked_prefill on: prompt chunks mixed with decode; "
                        "admission: worst_case instead of on_demand)")
    parser.add_argument("--stop-ids", type=int, default=0, help="this many random token ids stop a sample, so "
                        "samples end at varied lengths and groups are admitted as others finish (0: none)")
    parser.add_argument("--max-prefill-tokens", type=int, default=EngineOptions().max_prefill_tokens)
    parser.add_argument("--skip-checks", action="store_true", help="no greedy agreement checks before timing")
    parser.add_argument("--profile", action="store_true", help="profile a short rollout of the first shape per mode")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--tunings", type=json.loads, default=[{}],
                        help='JSON list of FCA Tuning overrides to compare, e.g. [{}, {"items_per_sm": 4}]')
    parser.add_argument("--shapes", type=json.loads, default=SHAPES, help="JSON [[prompts, samples, prompt_len], ...]")
    parser.add_argument("--filters", type=json.loads, default={},
                        help='sampling filters of the timed rollouts, e.g. {"top_p": 0.95, "top_k": 20}')
    args = parser.parse_args()
    if args.smoke:
        print(json.dumps(smoke("cuda" if torch.cuda.is_available() else "cpu")))
    elif torch.cuda.is_available():
        print(json.dumps(gpu(args)))
    else:
        sys.exit("no CUDA device: run with --smoke for the CPU check")


if __name__ == "__main__":
    main()
