"""GRPO step time of verl 0.9.1 (its unmodified ``main_ppo``) on Arctic, against verl's own path.

A Qwen3-1.7B-shaped random bf16 model, 8 prompts x 8 samples per step, prompts of P tokens, T new
tokens, one optimizer step per training step, gradient checkpointing, no KL (no reference model on
either side). Arctic: ``trainer.v1.trainer_mode=arctic`` (the embedded FCA sampler and the
DeepSpeed trainer in one server actor on the GPU). verl's own path (``--native``): its FSDP workers
and vLLM rollout, colocated, with the same data and settings.

    P=2048 T=512 STEPS=4 python3 bench/verl_step.py            # Arctic
    P=2048 T=512 STEPS=4 python3 bench/verl_step.py --native   # verl's own workers + vLLM
    uv run --extra verl python bench/verl_step.py --smoke      # a tiny model on the CPU, end to end

The reward is a function of the completion's length (so advantages are not all zero). The last
line is a JSON object: the step times verl logs (``timing_s/step``) and their steady mean.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from shapes import QWEN3_1_7B, SMOKE_SHAPE, make_model, random_prompt_texts

HERE = Path(__file__).resolve()
STEP_LINE = re.compile(r"step:(\d+) - (.*)$", re.M)
TIMING = re.compile(r"timing_s/(\w+):([0-9.]+)")


def length_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's reward-function signature (``reward.custom_reward_function``)."""
    return float(len(solution_str) % 7)


def write_dataset(folder: Path, tokenizer_folder: str, prompt_len: int, rows: int) -> Path:
    texts = random_prompt_texts(tokenizer_folder, prompt_len, rows)
    path = folder / "prompts.parquet"
    pd.DataFrame([{"data_source": "random", "prompt": [{"role": "user", "content": text}], "ability": "none",
                   "reward_model": {"style": "rule", "ground_truth": ""}} for text in texts]).to_parquet(path)
    return path


def main_ppo_args(model: str, data: Path, out: Path, smoke: bool, native: bool) -> list[str]:
    prompt_len, new_tokens = (int(os.environ.get("P", 64 if smoke else 2048)),
                              int(os.environ.get("T", 16 if smoke else 512)))
    prompts, samples = 8, 8
    args = [
        sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=grpo",
        f"data.train_files={data}", f"data.val_files={data}", f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={prompt_len}", f"data.max_response_length={new_tokens}", "data.truncation=left",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        f"actor_rollout_ref.rollout.n={samples}", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.use_kl_loss=False", "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={HERE}", "reward.custom_reward_function.name=length_reward",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=[console]",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.total_training_steps={os.environ.get('STEPS', 2 if smoke else 4)}",
        f"trainer.default_local_dir={out / 'checkpoints'}", "trainer.project_name=bench",
        "trainer.experiment_name=verl_step",
    ]
    if not native:
        args += ["trainer.v1.trainer_mode=arctic"]
    else:  # flash-attn has no wheel for the GPU machine's torch: verl's FSDP workers on SDPA, padded
        args += ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                 "actor_rollout_ref.model.use_remove_padding=False"]
    if smoke:
        args += ["trainer.device=cpu", "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1",
                 "transfer_queue.backend.SimpleStorage.num_data_storage_units=1", "+ray_kwargs.ray_init.num_cpus=8"]
    return args


def main() -> None:
    smoke, native = "--smoke" in sys.argv, "--native" in sys.argv
    if smoke and native:
        sys.exit("--smoke runs Arctic's path on the CPU; verl's own path needs a GPU and vLLM")
    model = "/tmp/tiny-qwen3-arctic" if smoke else "/tmp/qwen3-1.7b-shape-arctic"
    make_model(model, SMOKE_SHAPE if smoke else QWEN3_1_7B)
    out = Path(tempfile.mkdtemp(prefix="verl_step_"))
    data = write_dataset(out, model, int(os.environ.get("P", 64 if smoke else 2048)), rows=64)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(main_ppo_args(model, data, out, smoke, native), cwd=out, env=env, capture_output=True,
                          text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"main_ppo failed ({proc.returncode}):\n{output[-6000:]}")
    timings = {int(step): {name: float(value) for name, value in TIMING.findall(line)}
               for step, line in STEP_LINE.findall(output)}
    times = [timings[step]["step"] for step in sorted(timings)]
    steady = times[1:] or times
    last = timings[max(timings)]
    print(json.dumps({"system": "verl-0.9.1 " + ("native (FSDP + vLLM)" if native else "on arctic"),
                      "prompts": 8, "n": 8, "prompt_len": int(os.environ.get("P", 64 if smoke else 2048)),
                      "max_new": int(os.environ.get("T", 16 if smoke else 512)),
                      "step_s_steady_mean": round(sum(steady) / len(steady), 2), "steps": times,
                      "gen_s": [timings[step].get("gen") for step in sorted(timings)],
                      "last_step_timing_s": last}), flush=True)


if __name__ == "__main__":
    main()
