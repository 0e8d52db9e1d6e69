"""vLLM 0.24 with FCA (our CUSTOM attention backend, ``arctic_fca.vllm.attention``) against vLLM's
default attention, one engine per process, back to back (H200):

    python3 bench/vllm_fca.py --mode default --out /tmp/default.json
    python3 bench/vllm_fca.py --mode fca --out /tmp/fca.json --weight-sync
    python3 bench/vllm_fca.py --compare /tmp/default.json /tmp/fca.json
    # the greedy check without bf16 rounding: both modes in fp32 on vLLM's Triton backend
    python3 bench/vllm_fca.py --mode default --dtype float32 --greedy-only --out /tmp/default32.json

Each mode runs our ``vllm`` sampling backend (``VllmSampler``, ``fca`` on or off) on a random
bf16 Qwen3-1.7B-shaped model:
- greedy decoding of 64 prompts x 8 requests each (prompt 2048, 128 new tokens): the tokens and
  each step's gap between the best and second-best log-prob are saved; ``--compare`` counts the
  sequences identical in both modes and, where two part, how close to a tie that step was (bf16
  rounding can only flip near-ties; a wrong attention would part them at clear choices);
- generated tokens/s at 64 x 8 @ 2048, 16 x 16 @ 4096, 32 x 8 @ 7680, 4 x 64 @ 1024 (and 128 x 1
  @ 2048, where nothing is shared), 512 new tokens each, temperature 1, no stop (as vLLM's own
  figures in ../shared/ENVIRONMENT.md);
- ``--weight-sync``: the sampler runs inside our server (``ArcticClient.in_process``) next to our
  DeepSpeed trainer on the same GPU; one real training step (a PPO loss on a rollout from the
  engine), then ``sync_weights`` moves the trainer's weights into the running engine (CUDA IPC);
  the engine's weights must sum to the trainer's, its greedy tokens are compared with the trainer
  model's own ``generate``, and a sleep (level 1) and a wake must leave them unchanged.
The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from shapes import QWEN3_1_7B

SHAPES = [(64, 8, 2048), (16, 16, 4096), (32, 8, 7680), (4, 64, 1024),
          (128, 1, 2048)]  # the last shares nothing: FCA must cost nothing there
FOLDER = "/tmp/qwen3-1.7b-shape-vllm"


def shape_list(text: str) -> list[tuple[int, int, int]]:
    """``64x8@2048,4x64@1024`` -> [(64, 8, 2048), (4, 64, 1024)] (prompts x samples @ prompt length)."""
    shapes = []
    for item in text.split(","):
        counts, _, length = item.partition("@")
        prompts, _, samples = counts.partition("x")
        shapes.append((int(prompts), int(samples), int(length)))
    return shapes


def save_random_model(folder: str) -> None:
    """Random bf16 weights of the Qwen3-1.7B shape in ``folder`` (unless it holds a model already)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.exists(os.path.join(folder, "config.json")):
        return
    config = AutoConfig.for_model("qwen3", **QWEN3_1_7B, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 150000) for _ in range(length)] for _ in range(count)]


@contextlib.contextmanager
def py_spy(folder: str | None, name: str):
    """py-spy samples vLLM's engine-core process and this one (the frontend) while the block runs:
    where each spends its time, waits included (``--idle``), as collapsed stacks per thread in
    ``folder/name_{core,frontend}.txt``. A profiler that cannot attach leaves its error in the
    ``.err`` file next to it; the run goes on."""
    if not folder:
        yield
        return
    import psutil

    os.makedirs(folder, exist_ok=True)
    me = psutil.Process()
    cores = [c.pid for c in me.children(recursive=True) if "EngineCore" in c.name() + " ".join(c.cmdline())]
    with contextlib.ExitStack() as files:
        profilers = [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--idle", "--threads",
                                       "--nonblocking", "--format", "raw", "-o", f"{folder}/{name}_{role}.txt"],
                                      stdout=subprocess.DEVNULL,
                                      stderr=files.enter_context(open(f"{folder}/{name}_{role}.err", "w")))
                     for role, pid in [("frontend", me.pid)] + [("core", pid) for pid in cores]]
        try:
            yield
        finally:
            for profiler in profilers:
                profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            for profiler in profilers:
                profiler.wait(timeout=60)


def throughput(llm, vllm, prompts: int, samples: int, prompt_len: int, repeat: int = 1,
               profile_dir: str | None = None) -> dict:
    """Tokens/s of the whole run (the median of ``repeat`` runs, each on prompts of its own); and,
    as a breakdown, the seconds of the same shape with one new token each (prefill and the first
    step, on other prompts: the prefix cache must not help). ``profile_dir``: each timed run under
    py-spy (its figures then include the profiler's cost)."""

    def run(max_tokens: int, seed: int) -> tuple[float, int]:
        params = vllm.SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                                     detokenize=False)
        batch = [{"prompt_token_ids": p} for p in random_prompts(prompts, prompt_len, seed=seed)]
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started, sum(len(s.token_ids) for o in outputs for s in o.outputs)

    def timed_run(attempt: int) -> tuple[float, int]:
        # no "@" in the name: the device tool does not bring such files back
        with py_spy(profile_dir, f"{prompts}x{samples}at{prompt_len}_{attempt}"):
            return run(512, seed=prompt_len + prompts + 1000 * attempt)

    prefill_seconds, _ = run(1, seed=prompt_len + prompts + 1)
    started_at = time.strftime("%H:%M:%S")  # to find the run in a GPU trace (bench/vllm_h200.sh spread)
    runs = [timed_run(attempt) for attempt in range(repeat)]
    seconds, tokens = statistics.median(s for s, _ in runs), runs[0][1]
    return {"shape": f"{prompts}x{samples}@{prompt_len}", "started_at": started_at, "tokens": tokens,
            "seconds": round(seconds, 2), "tok_s": round(tokens / seconds), "prefill_s": round(prefill_seconds, 2),
            "runs_tok_s": [round(t / s) for s, t in runs]}


def greedy_with_gaps(llm, vllm, prompts: list[list[int]], tokens: int) -> list[dict]:
    """Greedy tokens and, per step, the log-prob gap between the chosen token and the runner-up:
    where two modes part, a gap near 0 means a near-tie that rounding alone can flip."""
    params = vllm.SamplingParams(n=1, temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=2,
                                 detokenize=False)
    rows = []
    for output in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        sample = output.outputs[0]
        gaps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in sample.logprobs]
        rows.append({"tokens": list(sample.token_ids), "gaps": [round(g[0] - g[1], 5) for g in gaps]})
    return rows


def greedy(sampler, prompts: list[list[int]], n: int, tokens: int) -> list[list[int]]:
    from arctic_core.config import SamplingParams

    batch = sampler.generate(prompts, SamplingParams(n=n, temperature=0.0, max_tokens=tokens))
    return [batch.response(i) for i in range(batch.num_responses)]


def weight_sync(client) -> dict:
    """One real step of our DeepSpeed trainer on a rollout from the running engine, its weights
    into that engine through the server's ``sync_weights`` (CUDA IPC), then: the engine's weights
    sum to the trainer's, its greedy tokens are compared with the trainer model's own ``generate``,
    and a sleep (level 1) and wake must leave them unchanged."""
    server = client.transport.server
    sampler, model = server.sampler, server.trainer.model
    prompts = random_prompts(8, 256, seed=7)
    rollout = client.generate(prompts, n=4, max_tokens=16, seed=3).batch
    advantages = torch.linspace(-1, 1, rollout.num_responses)
    rollout = rollout.replace(old_logprobs=client.log_probs(rollout).outputs["logprobs"], advantages=advantages,
                              rewards=advantages)
    client.fwd_bwd(rollout, "ppo")
    step = client.step().metrics
    before = greedy(sampler, prompts, 1, 32)
    started = time.perf_counter()
    synced = client.sync_weights()
    seconds = time.perf_counter() - started
    engine_sum = sum(sampler.llm.collective_rpc("arctic_weights_checksum"))
    trainer_sum = sum(float(p.double().sum()) for p in model.parameters())  # tied weights once, as vLLM
    after = client.generate(prompts, n=1, temperature=0.0, max_tokens=32).batch
    repeated = greedy(sampler, prompts, 1, 32)  # the same call again: run-to-run changes, apart from sleep's
    client.sleep(["sampler"])
    asleep_gib = torch.cuda.mem_get_info()[0] / 2**30
    client.wake(["sampler"])
    after_wake = greedy(sampler, prompts, 1, 32)
    expected = trainer_greedy(model, prompts, 32)
    tokens = [after.response(i) for i in range(after.num_responses)]
    return {"grad_norm": step["grad_norm"], "sync_s": round(seconds, 3), "policy_version": synced.policy_version,
            "versions_reported": sorted(set(after.policy_version.tolist())),
            "engine_weight_sum": engine_sum, "trainer_weight_sum": trainer_sum,
            "greedy_equal_to_trainer": sum(a == e for a, e in zip(tokens, expected, strict=True)),
            "greedy_equal_before_sync": sum(b == e for b, e in zip(before, expected, strict=True)),
            "prompts": len(prompts),
            "first_token_equal_to_trainer": sum(a[0] == e[0] for a, e in zip(tokens, expected, strict=True)),
            "free_gib_while_asleep": round(asleep_gib, 1), "greedy_same_when_repeated": repeated == tokens,
            "greedy_same_after_sleep_wake": after_wake == tokens}


def trainer_greedy(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The trainer's own greedy tokens: its model is routed to ZoRRo's packed attention, which
    serves training batches only, so ``generate`` runs it on SDPA, then the routing is restored."""
    from arctic_core.hf import set_attention_implementation

    packed, device = model.config._attn_implementation, next(model.parameters()).device
    set_attention_implementation(model, "sdpa")
    try:
        with torch.no_grad():
            return [model.generate(torch.tensor([p], device=device), do_sample=False,
                                   max_new_tokens=tokens)[0, len(p):].tolist() for p in prompts]
    finally:
        set_attention_implementation(model, packed)


def start_sampler(args, options: dict):
    """The vLLM sampler alone, or (``--weight-sync``) inside our server, next to our DeepSpeed
    trainer on the same weights: returns (sampler, client or None)."""
    from arctic_core.client import ArcticClient
    from arctic_core.config import ArcticConfig, ModelConfig, SamplerConfig
    from arctic_fca.vllm.sampler import VllmSampler

    model = {"path": FOLDER, "dtype": args.dtype, "device": "cuda"}
    sampler = {"backend": "vllm", "options": options}
    if not args.weight_sync:
        return VllmSampler(SamplerConfig(**sampler), ModelConfig(**model), seed=0), None
    client = ArcticClient.in_process(ArcticConfig.from_dict(
        {"model": model, "sampler": sampler, "trainer": {"optimizer": {"lr": 1e-3}}, "seed": 0}))
    return client.transport.server.sampler, client


def run_mode(args) -> dict:
    save_random_model(FOLDER)
    torch.cuda.empty_cache()
    started = time.perf_counter()
    options = {"fca": args.mode == "fca", "gpu_memory_utilization": 0.6, "max_model_len": 8192}
    if args.dtype == "float32":  # FlashAttention has no fp32: both modes on vLLM's Triton backend
        # whose tl.dot rounds fp32 inputs to TF32 by default (10-bit mantissas): IEEE fp32 instead,
        # in vLLM's processes too (they inherit the environment), or the check measures TF32 noise.
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        options["fca_base"] = "TRITON_ATTN"
        if args.mode == "default":
            options["engine_args"] = {"attention_config": {"backend": "TRITON_ATTN"}}
    sampler, client = start_sampler(args, options)
    result = {"mode": args.mode, "dtype": args.dtype,
              "fca_host_views": sampler.fca_host_views,
              "engine_start_s": round(time.perf_counter() - started, 1), "throughput": []}
    print(result, flush=True)

    def save() -> None:  # after every part: a run cut short by its time limit keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)

    # Eight requests per prompt (vLLM refuses n > 1 for greedy): they share the prompt's KV blocks.
    prompts = [p for p in random_prompts(64, 2048, seed=1) for _ in range(8)]
    before = sampler.fca_stats()
    result["greedy"] = greedy_with_gaps(sampler.llm, sampler.vllm, prompts, 128)
    result["greedy_fca"] = fca_counts_since(sampler, before)  # were mixed batches split in the check?
    save()
    for shape in [] if args.greedy_only else args.shapes:
        before = sampler.fca_stats()
        result["throughput"].append(throughput(sampler.llm, sampler.vllm, *shape, repeat=args.repeat,
                                               profile_dir=args.py_spy))
        result["throughput"][-1]["fca"] = fca_counts_since(sampler, before)
        print(result["throughput"][-1], flush=True)
        save()
    if client is not None:
        result["weight_sync"] = weight_sync(client)
        print(result["weight_sync"], flush=True)
        save()
    return result


def fca_counts_since(sampler, before: dict) -> dict:
    """FCA's batches (decode / mixed / base) and work builds (forest / reuse / plain) since
    ``before`` (an earlier ``fca_stats()``)."""
    return {k: v - before.get(k, 0) for k, v in sampler.fca_stats().items()}


def compare(default_path: str, fca_path: str) -> dict:
    default, fca = (json.load(open(p)) for p in (default_path, fca_path))
    pairs = [(d["tokens"], f["tokens"]) for d, f in zip(default["greedy"], fca["greedy"], strict=True)]
    common = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x)) for x, y in pairs]
    # At the first differing step both modes saw the same context: how close to a tie was it?
    split_gaps = [max(d["gaps"][i], f["gaps"][i])
                  for d, f, i in zip(default["greedy"], fca["greedy"], common, strict=True) if i < len(d["tokens"])]
    rows = [{"shape": d["shape"], "default_tok_s": d["tok_s"], "fca_tok_s": f["tok_s"],
             "runs_tok_s": [d.get("runs_tok_s"), f.get("runs_tok_s")],
             "speedup": round(f["tok_s"] / d["tok_s"], 2), "prefill_s": [d["prefill_s"], f["prefill_s"]],
             # the steps after the first: total time less that of the one-token run
             "decode_speedup": round((d["seconds"] - d["prefill_s"]) / (f["seconds"] - f["prefill_s"]), 2)}
            for d, f in zip(default["throughput"], fca["throughput"], strict=False)]
    for row in rows:
        print(row)
    return {"greedy_identical": sum(x == y for x, y in pairs), "greedy_sequences": len(pairs),
            "greedy_mean_common_prefix": round(sum(common) / len(common), 1),
            "largest_gap_where_they_part": max(split_gaps, default=None),
            "median_gap_overall": statistics.median(g for d in default["greedy"] for g in d["gaps"]), "rows": rows,
            "weight_sync": fca.get("weight_sync"), "default_weight_sync": default.get("weight_sync")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["default", "fca"])
    parser.add_argument("--out")
    parser.add_argument("--weight-sync", action="store_true")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="float32: both modes on vLLM's Triton backend, for a greedy check free of bf16 rounding")
    parser.add_argument("--greedy-only", action="store_true", help="skip the throughput runs")
    parser.add_argument("--shapes", type=shape_list, default=SHAPES,
                        help="throughput shapes, e.g. 128x1@2048,4x64@1024 (default: all five)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed runs per shape, each on prompts of its own; tok/s is their median")
    parser.add_argument("--py-spy", metavar="DIR", help="each timed run under py-spy, its stacks into DIR")
    parser.add_argument("--compare", nargs=2, metavar=("DEFAULT_JSON", "FCA_JSON"))
    args = parser.parse_args()
    if args.compare:
        print(json.dumps(compare(*args.compare)))
        return
    result = run_mode(args)
    print(json.dumps({k: v for k, v in result.items() if k != "greedy"}))
    os._exit(0)  # vLLM's engine-core process and NCCL teardown can hang at interpreter exit


if __name__ == "__main__":
    main()
