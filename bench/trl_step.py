"""GRPO step time of TRL on Arctic on one GPU: a Qwen3-1.7B-shaped random bf16 model, 8 prompts x 8
samples per optimizer step, 512 new tokens, prompts of P random tokens, gradient checkpointing.
The baseline is the same TRL script on TRL's own GRPOTrainer with vLLM in colocate mode.

    P=2048 STEPS=4 python3 bench/trl_step.py               # the embedded sampler
    P=2048 STEPS=4 SAMPLER=vllm python3 bench/trl_step.py   # vLLM 0.24 + FCA as Arctic's sampler
    P=2048 STEPS=4 CHECKPOINT_LAYERS=all python3 bench/trl_step.py   # recompute every layer (default: auto)
    P=2048 STEPS=4 COMPILE_ELEMENTWISE=0 python3 bench/trl_step.py   # norms and SiLU x up eager (default: auto)
    TIME_PREFILL=1 P=4096 STEPS=5 python3 bench/trl_step.py  # each prefill pass timed on its own
    PROFILE_STEP=4 P=4096 STEPS=5 python3 bench/trl_step.py  # the 4th step's Python calls (cProfile)
    SYNC_CALLS=1 P=4096 STEPS=7 python3 bench/trl_step.py  # each call's device work counted as its own
    DEVICE_PROFILE_STEP=4 P=4096 STEPS=4 python3 bench/trl_step.py  # where the 4th step's device waits
    SYNC_DEBUG_STEP=4 P=4096 STEPS=4 python3 bench/trl_step.py  # where the 4th step's host waits for the device
    ZERO_STAGE=2 P=4096 STEPS=5 python3 bench/trl_step.py  # DeepSpeed ZeRO stage 2 (the adapter's choice here: 1)
    SAMPLER_CORRECTION=0 P=4096 STEPS=7 python3 bench/trl_step.py  # without TRL's importance sampling correction
    FLEX=any-length P=4096 STEPS=7 python3 bench/trl_step.py  # FlexAttention unpadded, compiled for any length
    BF16_ACCUMULATION=deepspeed P=4096 STEPS=7 python3 bench/trl_step.py  # stage 1: DeepSpeed's own gradient sums
    PROCESSORS=compiled P=4096 STEPS=7 python3 bench/trl_step.py  # log-probs and entropy compiled, not the kernels
    HEAD_RECOMPUTE=1 P=4096 STEPS=7 python3 bench/trl_step.py  # LM-head chunks recomputed in the backward
                                                               # even where memory holds their logits
    SAMPLER_MEMORY=0.35 P=4096 STEPS=7 python3 bench/trl_step.py  # the sampler's KV cache a share of the card,
                                                                  # not the rollout's size
    ADMISSION=worst_case SAMPLER_MEMORY=0.35 P=4096 STEPS=7 python3 bench/trl_step.py  # groups wait for their
                                                                                       # max_tokens' blocks
    uv run python bench/trl_step.py --smoke                # a tiny model on the CPU, end to end

    P=2048 STEPS=6 python3 bench/trl_step.py --baseline    # the baseline: TRL's own GRPOTrainer, vLLM colocate
    uv run python bench/trl_step.py --smoke --baseline     # its harness on the CPU (TRL generates, no vLLM)

The only change from a plain TRL script is the import of GRPOTrainer: the backend runs in process,
the DeepSpeed trainer and the sampler sharing the GPU (the sampler's memory is capped so the
trainer fits beside it). ``--baseline`` runs the same script, model, prompts, reward and settings on
TRL's own GRPOTrainer with vLLM in colocate mode (``vllm_gpu_memory_utilization`` 0.35 or
``SAMPLER_MEMORY``; vLLM 0.24 must be installed). The last line is a JSON object: each step's
seconds, and the median of the steady steps (after the first two, which compile kernels and
capture CUDA graphs on both sides) with their range.
"""

from __future__ import annotations

import cProfile
import gc
import json
import logging
import os
import pstats
import random
import sys
import time
import statistics
import traceback
import warnings

import torch
import trl
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig

from arctic_trl import GRPOTrainer
from device_idle import PHASE_PREFIX, idle_report
from prefill_passes import time_prefill_passes
from shapes import QWEN3_1_7B, SMOKE_SHAPE, make_model


CLIENT_CALLS = ("generate", "log_probs", "fwd_bwd", "step", "sync_weights")


class StepTimer(TrainerCallback):
    """Each optimizer step's wall time, how much of it each backend call took (calls, seconds), the
    garbage collector's pauses by generation, and with the in-process embedded sampler its prefill
    and decode seconds (``TIME_PREFILL=1``: each prefill pass, between device synchronisations).
    ``SYNC_CALLS=1``: each call ends in a device synchronisation; ``PROFILE_STEP=K``: cProfile of step K
    (``PROFILE_DUMP=path``: its stats saved);
    ``DEVICE_PROFILE_STEP=K``: the device's idle time in step K, by call, and its longest gaps;
    ``SYNC_DEBUG_STEP=K``: each place where step K's host waited for the device, by call."""

    def __init__(self) -> None:
        self.begin, self.steps, self.calls, self.engine, self.engine_before = 0.0, [], {}, None, {}
        self.passes: list[tuple[float, float, float]] = []
        self.profile: cProfile.Profile | None = None
        self.device_profile: torch.profiler.profile | None = None
        self.spans: list[tuple[str, float, float]] = []  # each backend call: name, begin, end
        self.begin_counter = self.end_counter = 0.0
        self.sync_points: SyncPoints | None = None

    def wrap(self, client) -> None:
        for name in CLIENT_CALLS:
            setattr(client, name, self._timed(name, getattr(client, name)))
        # The embedded sampler's own split of generate (in process only): prefill, decode, steps.
        sampler = getattr(getattr(client.transport, "server", None), "sampler", None)
        self.engine = getattr(sampler, "engine", None)
        if self.engine is not None and os.environ.get("TIME_PREFILL"):  # each prefill pass, synchronised
            self.passes = time_prefill_passes(self.engine)
        self.gc_pauses, self._gc_begin = {}, 0.0
        gc.callbacks.append(self._gc_pause)

    def _gc_pause(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_begin = time.perf_counter()
        else:  # by generation: (collections, seconds)
            count, seconds = self.gc_pauses.get(info["generation"], (0, 0.0))
            self.gc_pauses[info["generation"]] = (count + 1, round(seconds + time.perf_counter() - self._gc_begin, 3))

    def _timed(self, name, call):
        # SYNC_CALLS=1: each call's device work counts as its own (not as the host work after it).
        sync = torch.cuda.synchronize if os.environ.get("SYNC_CALLS") and torch.cuda.is_available() else lambda: None

        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                if self.sync_points is not None:
                    self.sync_points.phase = name
                with torch.profiler.record_function(PHASE_PREFIX + name):
                    return call(*args, **kwargs)
            finally:
                if self.sync_points is not None:
                    self.sync_points.phase = "outside"
                sync()
                count, seconds = self.calls.get(name, (0, 0.0))
                self.calls[name] = (count + 1, seconds + time.perf_counter() - begin)
                self.spans.append((name, begin, time.perf_counter()))
        return timed

    def on_step_begin(self, args, state, control, **kwargs):
        if len(self.steps) + 1 == int(os.environ.get("PROFILE_STEP", 0)):  # this step's Python calls, profiled
            self.profile = cProfile.Profile()
            self.profile.enable()
        if len(self.steps) + 1 == int(os.environ.get("DEVICE_PROFILE_STEP", 0)):
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.device_profile = torch.profiler.profile(activities=activities)
            self.device_profile.start()
        if len(self.steps) + 1 == int(os.environ.get("SYNC_DEBUG_STEP", 0)):
            self.sync_points = SyncPoints()
        self.begin, self.calls, self.gc_pauses = time.time(), {}, {}
        self.spans, self.begin_counter = [], time.perf_counter()
        self.passes.clear()
        self.engine_before = self._engine_stats()

    def _engine_stats(self) -> dict[str, float]:
        stats = vars(self.engine.stats) if self.engine is not None else {}
        kept = ("prefill_seconds", "decode_seconds", "decode_steps", "calls_in_waves", "preempted")
        out = {k: stats[k] for k in kept if k in stats}
        if torch.cuda.is_available():  # the caching allocator's trips to the driver (each may synchronise)
            memory = torch.cuda.memory_stats()
            out.update({k: memory.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")})
        return out

    def _gaps(self) -> str:
        """The host's time between backend calls (TRL's work, or waiting for the device), in order."""
        end = self.end_counter
        edges = [("begin", self.begin_counter, self.begin_counter), *self.spans, ("end", end, end)]
        gaps = [f"{a[0]}>{b[0]} {1e3 * (b[1] - a[2]):.0f}" for a, b in zip(edges, edges[1:], strict=False)]
        return ", ".join(gaps)

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.steps.append(time.time() - self.begin)
        self.end_counter = time.perf_counter()
        calls = ", ".join(f"{name} {count}x {seconds:.2f} s" for name, (count, seconds) in self.calls.items())
        outside = self.steps[-1] - sum(seconds for _, seconds in self.calls.values())
        engine = {k: round(v - self.engine_before.get(k, 0), 3) for k, v in self._engine_stats().items()}
        print("step", len(self.steps), round(self.steps[-1], 2), "s:", calls, f"; outside the backend {outside:.2f} s",
              f"; garbage collections by generation {self.gc_pauses} (oldest holds {len(gc.get_objects(2)):,})",
              f"; sampler {engine}" if engine else "",
              f"; prefill passes (wall, host, device) {self.passes}" if self.passes else "",
              f"; outside the backend, ms: {self._gaps()}", flush=True)
        if self.profile is not None:
            self.profile.disable()
            stats = pstats.Stats(self.profile)
            if os.environ.get("PROFILE_DUMP"):  # the whole profile, for pstats / snakeviz
                stats.dump_stats(os.environ["PROFILE_DUMP"])
            stats.sort_stats("cumulative").print_stats(70)
            stats.sort_stats("tottime").print_stats(30)
            self.profile = None
        if self.device_profile is not None:
            self.device_profile.stop()
            print(idle_report(self.device_profile, top_kernels=40), flush=True)
            self.device_profile = None
        if self.sync_points is not None:
            print(self.sync_points.close(), flush=True)
            self.sync_points = None


class SyncPoints:
    """Counts the step's synchronizing CUDA operations (``torch.cuda.set_sync_debug_mode``) by backend call
    (or ``outside``) and by the innermost frames of our code and TRL's that led to each."""

    def __init__(self) -> None:
        self.phase, self.counts = "outside", {}
        self._show, self._filters = warnings.showwarning, list(warnings.filters)
        warnings.showwarning = self._record
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        ours = [f for f in traceback.extract_stack()[:-2] if any(k in f.filename for k in ("arctic", "trl", "bench"))]
        where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours[-4:]))
        key = (self.phase, where)
        self.counts[key] = self.counts.get(key, 0) + 1

    def close(self) -> str:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning, warnings.filters[:] = self._show, self._filters
        rows = sorted(self.counts.items(), key=lambda kv: (kv[0][0], -kv[1]))
        return "\n".join(["synchronizing CUDA operations (call, count, where):"] +
                         [f"  {phase} {count}x {where}" for (phase, where), count in rows])


def flex_for_any_length() -> None:
    """The backend's FlexAttention before padding: unpadded, torch.compile's default dynamism."""
    from arctic_zorro import forest_attention

    kernels = forest_attention.FlexKernels(static_lengths=0)
    forest_attention.flex_kernels, forest_attention.padded_length = (lambda: kernels), (lambda n: n)


def rollout_kv_tokens(tokenizer, texts: list[str], prompts: int, samples: int, new_tokens: int) -> int:
    """The embedded sampler's KV cache sized to run a rollout's groups at once (each prompt once, each
    sample's own tokens, block rounding), whatever the card: the trainer beside it gets the rest. A
    share of the card (SAMPLER_MEMORY) leaves the cache short on 80 GB cards, and the groups then
    decode in waves, each to its end."""
    longest = max(len(tokenizer(text)["input_ids"]) for text in texts)
    return prompts * (longest + 16 + samples * (new_tokens + 32))


def compiled_processors() -> None:
    """The log-prob and entropy processors as torch.compile'd expressions (before their Triton kernels)."""
    from arctic_core.compiling import compiled
    from arctic_core.losses import processors as p

    p.LogProbs.__call__ = lambda self, logits, targets: {
        "logprobs": compiled(p.log_probs_at)(logits, targets, self.temperature)}
    p.Entropy.__call__ = lambda self, logits, targets: {"entropy": compiled(p.entropy_of)(logits, self.temperature)}


def main() -> None:
    smoke = "--smoke" in sys.argv  # a tiny model on the CPU: checks the harness end to end in seconds
    baseline = "--baseline" in sys.argv  # TRL's own GRPOTrainer (vLLM colocate on a GPU)
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench/trl_step.py measures a GPU; run it with --smoke on the CPU")
    folder = "/tmp/tiny-qwen3-arctic" if smoke else "/tmp/qwen3-1.7b-shape-arctic"
    started = time.time()
    make_model(folder, SMOKE_SHAPE if smoke else QWEN3_1_7B)
    print("model ready", round(time.time() - started, 1), "s", flush=True)
    prompt_len, samples = int(os.environ.get("P", 64 if smoke else 2048)), 8
    prompts, new_tokens = int(os.environ.get("PROMPTS", 8)), int(os.environ.get("T", 16 if smoke else 512))
    random.seed(0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [tokenizer.decode([random.randrange(3, 999) for _ in range(prompt_len)]) for _ in range(prompts * 4)]

    def reward(completions, **kwargs):
        return [float(len(c) % 7) for c in completions]

    sampler_memory = os.environ.get("SAMPLER_MEMORY")  # the sampler's share of the card
    # The baseline's vLLM shares the card at 0.35, as TRL's colocate examples size it; vLLM does not
    # run on this harness's CPU, where TRL generates with transformers instead.
    vllm = {"use_vllm": not smoke, "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": float(sampler_memory or 0.35)} if baseline else {}
    args = GRPOConfig(output_dir="/tmp/trl_arctic_out", per_device_train_batch_size=8,
                      gradient_accumulation_steps=prompts * samples // 8, num_generations=samples,
                      max_completion_length=new_tokens, bf16=not smoke, use_cpu=smoke, gradient_checkpointing=True,
                      learning_rate=1e-6, logging_steps=1, max_steps=int(os.environ.get("STEPS", 2 if smoke else 4)),
                      report_to=[], temperature=1.0, beta=0.0, save_strategy="no",
                      vllm_importance_sampling_correction=os.environ.get("SAMPLER_CORRECTION", "1") != "0", **vllm)
    timer = StepTimer()
    dataset = Dataset.from_dict({"prompt": texts})
    if baseline:
        trainer = trl.GRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=dataset,
                                  callbacks=[timer])
        system, sampler = f"trl-{trl.__version__}", "vllm colocate" if args.use_vllm else "transformers generate"
    else:
        trainer, sampler = arctic_trainer(folder, reward, args, dataset, timer, rollout_kv_tokens(
            tokenizer, texts, prompts, samples, new_tokens), sampler_memory)
        system = f"trl-{trl.__version__} on arctic"
    print("backend ready", round(time.time() - started, 1), "s", flush=True)
    trainer.train()
    # The first two steps compile kernels and capture CUDA graphs (the second meets new shapes).
    steady = timer.steps[2:] or timer.steps
    print(json.dumps({"system": system, "sampler": sampler, "prompts": prompts, "n": samples, "prompt_len": prompt_len,
                      "max_new": new_tokens, "step_s_steady_median": round(statistics.median(steady), 2),
                      "step_s_steady_range": [round(min(steady), 2), round(max(steady), 2)],
                      "step_s_steady_mean": round(sum(steady) / len(steady), 2),
                      "steps": [round(s, 2) for s in timer.steps]}), flush=True)


def arctic_trainer(folder, reward, args, dataset, timer, kv_tokens: int, sampler_memory: str | None):
    """TRL's GRPO script on Arctic (the changed import), with the bench's variants from the environment."""
    if os.environ.get("SAMPLER", "embedded") == "vllm":  # the same switch a user flips: arctic={"sampler": ...}
        sampler = {"backend": "vllm", "options": {"gpu_memory_utilization": float(sampler_memory or 0.35), "fca": True}}
    elif sampler_memory:
        sampler = {"options": {"gpu_memory_utilization": float(sampler_memory)}}
    else:
        sampler = {"options": {"kv_cache_tokens": kv_tokens}}
    if os.environ.get("ADMISSION"):  # the embedded engine's: on_demand (default) or worst_case
        sampler["options"]["admission"] = os.environ["ADMISSION"]
    arctic = {"sampler": sampler}
    trainer_options = {}
    layers = os.environ.get("CHECKPOINT_LAYERS")  # the adapter's default is auto
    if layers:
        trainer_options["checkpoint_layers"] = None if layers == "all" else layers if layers == "auto" else int(layers)
    compiled = os.environ.get("COMPILE_ELEMENTWISE")  # the default is auto
    if compiled:
        trainer_options["compile_elementwise"] = {"0": False, "1": True}.get(compiled, compiled)
    if os.environ.get("ZERO_STAGE"):  # the adapter picks 1 for bf16 on one process
        trainer_options["options"] = {"zero_stage": int(os.environ["ZERO_STAGE"])}
    if trainer_options:
        arctic["trainer"] = trainer_options
    # Which layers checkpoint_layers: auto keeps, as it changes them.
    logging.getLogger("arctic_zorro.checkpoint_policy").setLevel(logging.INFO)
    logging.getLogger("arctic_zorro.checkpoint_policy").addHandler(logging.StreamHandler(sys.stdout))
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=dataset, callbacks=[timer],
                          arctic=arctic)
    timer.wrap(trainer.arctic)
    if os.environ.get("FLEX") == "any-length":
        flex_for_any_length()
    if os.environ.get("PROCESSORS") == "compiled":
        compiled_processors()
    if os.environ.get("HEAD_RECOMPUTE") == "1":
        from arctic_zorro import packed_forward

        packed_forward.logits_fit = lambda hidden, vocab, chunk_tokens: False
    if os.environ.get("BF16_ACCUMULATION") == "deepspeed":
        from arctic_zorro import deepspeed_engine

        deepspeed_engine.accumulate_bf16_grads_in_one_pass = lambda optimizer: None
    return trainer, sampler.get("backend", "embedded")


if __name__ == "__main__":
    main()
