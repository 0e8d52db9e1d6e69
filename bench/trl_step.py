"""GRPO step time of TRL on Arctic on one GPU: a Qwen3-1.7B-shaped random bf16 model, 8 prompts x 8
samples per optimizer step, 512 new tokens, prompts of P random tokens, gradient checkpointing.
The baseline is the same TRL script on TRL's own GRPOTrainer with vLLM in colocate mode.

    P=2048 STEPS=4 python3 bench/trl_step.py               # the embedded sampler
    P=2048 STEPS=4 SAMPLER=vllm python3 bench/trl_step.py   # vLLM 0.24 + FCA as Arctic's sampler
    P=2048 STEPS=4 CHECKPOINT_LAYERS=all python3 bench/trl_step.py   # recompute every layer (default: auto)
    P=2048 STEPS=4 COMPILE_ELEMENTWISE=0 python3 bench/trl_step.py   # norms and SiLU x up eager (default: auto)
    uv run python bench/trl_step.py --smoke                # a tiny model on the CPU, end to end

The only change from a plain TRL script is the import of GRPOTrainer: the backend runs in process,
the DeepSpeed trainer and the sampler sharing the GPU (the sampler's memory is capped so the
trainer fits beside it). The last line is a JSON object.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig

from arctic_trl import GRPOTrainer
from shapes import QWEN3_1_7B, SMOKE_SHAPE, make_model


CLIENT_CALLS = ("generate", "log_probs", "fwd_bwd", "step", "sync_weights")


class StepTimer(TrainerCallback):
    """Each optimizer step's wall time, and how much of it each backend call took (calls, seconds)."""

    def __init__(self) -> None:
        self.begin, self.steps, self.calls = 0.0, [], {}

    def wrap(self, client) -> None:
        for name in CLIENT_CALLS:
            setattr(client, name, self._timed(name, getattr(client, name)))

    def _timed(self, name, call):
        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                count, seconds = self.calls.get(name, (0, 0.0))
                self.calls[name] = (count + 1, seconds + time.perf_counter() - begin)
        return timed

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin, self.calls = time.time(), {}

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.steps.append(time.time() - self.begin)
        calls = ", ".join(f"{name} {count}x {seconds:.2f} s" for name, (count, seconds) in self.calls.items())
        outside = self.steps[-1] - sum(seconds for _, seconds in self.calls.values())
        print("step", len(self.steps), round(self.steps[-1], 2), "s:", calls, f"; outside the backend {outside:.2f} s",
              flush=True)


def main() -> None:
    smoke = "--smoke" in sys.argv  # a tiny model on the CPU: checks the harness end to end in seconds
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench/trl_step.py measures the H200; run it with --smoke on the CPU")
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

    args = GRPOConfig(output_dir="/tmp/trl_arctic_out", per_device_train_batch_size=8,
                      gradient_accumulation_steps=prompts * samples // 8, num_generations=samples,
                      max_completion_length=new_tokens, bf16=not smoke, use_cpu=smoke, gradient_checkpointing=True, learning_rate=1e-6,
                      logging_steps=1, max_steps=int(os.environ.get("STEPS", 2 if smoke else 4)), report_to=[], temperature=1.0,
                      beta=0.0, save_strategy="no")
    timer = StepTimer()
    sampler = {"options": {"gpu_memory_utilization": float(os.environ.get("SAMPLER_MEMORY", 0.35))}}
    if os.environ.get("SAMPLER", "embedded") == "vllm":  # the same switch a user flips: arctic={"sampler": ...}
        sampler = {"backend": "vllm", "options": {**sampler["options"], "fca": True}}
    arctic = {"sampler": sampler}
    trainer_options = {}
    layers = os.environ.get("CHECKPOINT_LAYERS")  # the adapter's default is auto
    if layers:
        trainer_options["checkpoint_layers"] = None if layers == "all" else layers if layers == "auto" else int(layers)
    compiled = os.environ.get("COMPILE_ELEMENTWISE")  # the default is auto
    if compiled:
        trainer_options["compile_elementwise"] = {"0": False, "1": True}.get(compiled, compiled)
    if trainer_options:
        arctic["trainer"] = trainer_options
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": texts}),
                          callbacks=[timer], arctic=arctic)
    timer.wrap(trainer.arctic)
    print("backend ready", round(time.time() - started, 1), "s", flush=True)
    trainer.train()
    # The first two steps compile kernels and capture CUDA graphs (the second meets new shapes).
    steady = timer.steps[2:] or timer.steps
    print(json.dumps({"system": "trl-1.16 on arctic", "sampler": arctic["sampler"].get("backend", "embedded"),
                      "prompts": prompts, "n": samples, "prompt_len": prompt_len,
                      "max_new": new_tokens, "step_s_steady_mean": round(sum(steady) / len(steady), 2),
                      "steps": [round(s, 2) for s in timer.steps]}), flush=True)


if __name__ == "__main__":
    main()
