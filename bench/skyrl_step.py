"""GRPO step time of SkyRL 0.4 (its unmodified ``main_base``) on Arctic, against SkyRL's own path.

A Qwen3-1.7B-shaped random bf16 model, 8 prompts x 8 samples per step, prompts of P tokens, T new
tokens, one optimizer step per training step, gradient checkpointing, no KL (no reference model on
either side). Arctic: ``trainer.override_entrypoint=arctic_skyrl.entrypoint`` (the embedded FCA
sampler and the DeepSpeed trainer in the training process). SkyRL's own path (``--native``): its
FSDP workers and vLLM engine, colocated, with the same data and settings.

    P=2048 T=512 STEPS=4 python3 bench/skyrl_step.py            # Arctic
    P=2048 T=512 STEPS=4 python3 bench/skyrl_step.py --native   # SkyRL's own workers + vLLM
    uv run --extra skyrl python bench/skyrl_step.py --smoke      # a tiny model on the CPU, end to end

Prompts are scored by skyrl-gym's gsm8k environment (a random model scores 0; the step's work is
the same). The last line is a JSON object: the step times SkyRL logs (``timing/step``), their
steady mean, and the steady means of the step's parts (generation, log-probs, training, sync).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from shapes import QWEN3_1_7B, SMOKE_SHAPE, make_model, random_prompt_texts

PROMPTS, SAMPLES = 8, 8


def write_dataset(folder: Path, tokenizer_folder: str, prompt_len: int, rows: int) -> Path:
    from transformers import AutoTokenizer

    # SkyRL filters prompts longer than trainer.max_prompt_length and never truncates: cut each
    # text to prompt_len tokens (a decoded text re-encodes to about its token count).
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    texts = [tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:prompt_len])
             for text in random_prompt_texts(tokenizer_folder, prompt_len, rows)]
    path = folder / "prompts.parquet"
    pd.DataFrame([{"data_source": "random", "prompt": [{"role": "user", "content": text}], "env_class": "gsm8k",
                   "reward_spec": {"method": "rule", "ground_truth": "0"}} for text in texts]).to_parquet(path)
    return path


def main_base_args(model: str, data: Path, out: Path, smoke: bool, native: bool) -> list[str]:
    prompt_len, new_tokens = (int(os.environ.get("P", 64 if smoke else 2048)),
                              int(os.environ.get("T", 16 if smoke else 512)))
    args = [
        sys.executable, "-m", "skyrl.train.entrypoints.main_base",
        f"data.train_data=['{data}']", f"trainer.policy.model.path={model}",
        f"trainer.train_batch_size={PROMPTS}", f"trainer.policy_mini_batch_size={PROMPTS}",
        f"generator.n_samples_per_prompt={SAMPLES}", f"trainer.max_prompt_length={2 * prompt_len}",
        f"generator.sampling_params.max_generate_length={new_tokens}",
        "trainer.algorithm.advantage_estimator=grpo", "trainer.algorithm.use_kl_loss=false",
        "trainer.gradient_checkpointing=true", "trainer.micro_train_batch_size_per_gpu=8",
        "trainer.micro_forward_batch_size_per_gpu=8", "trainer.policy.optimizer_config.lr=1e-6",
        f"trainer.max_training_steps={os.environ.get('STEPS', 2 if smoke else 4)}", "trainer.epochs=100",
        "trainer.eval_interval=-1", "trainer.eval_before_train=false", "trainer.ckpt_interval=-1",
        f"trainer.ckpt_path={out / 'ckpts'}", f"trainer.export_path={out / 'exports'}",
        f"trainer.log_path={out / 'logs'}",
        "trainer.logger=tensorboard", "trainer.enable_ray_gpu_monitor=false", "data.dataloader.num_workers=0",
        "trainer.placement.colocate_all=true", "generator.inference_engine.num_engines=1",
        "generator.inference_engine.gpu_memory_utilization=0.4",
    ]
    if not native:
        args += ["trainer.override_entrypoint=arctic_skyrl.entrypoint"]
    return args


BREAKDOWN = ("timing/generate", "timing/fwd_logprobs_values_reward", "timing/policy_train", "timing/sync_weights",
             "generate/batch_padded_seq_len")


def logged(folder: Path) -> dict[str, list[float]]:
    """The step time and its parts as SkyRL logged them, per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in set(accumulator.Tags()["scalars"]) & {"timing/step", *BREAKDOWN}:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return {tag: [values[step] for step in sorted(values)] for tag, values in scalars.items()}


def main() -> None:
    smoke, native = "--smoke" in sys.argv, "--native" in sys.argv
    if smoke and native:
        sys.exit("--smoke runs Arctic's path on the CPU; SkyRL's own path needs a GPU, vLLM and flash-attn")
    model = "/tmp/tiny-qwen3-arctic" if smoke else "/tmp/qwen3-1.7b-shape-arctic"
    make_model(model, SMOKE_SHAPE if smoke else QWEN3_1_7B)
    out = Path(tempfile.mkdtemp(prefix="skyrl_step_"))
    data = write_dataset(out, model, int(os.environ.get("P", 64 if smoke else 2048)), rows=64)
    env = {**os.environ, "TENSORBOARD_DIR": str(out / "tensorboard")}
    proc = subprocess.run(main_base_args(model, data, out, smoke, native), cwd=out, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"main_base failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    series = logged(out / "tensorboard")
    times = series["timing/step"]
    steady = times[1:] or times
    parts = {tag: round(sum(values[1:] or values) / len(values[1:] or values), 2) for tag, values in series.items()
             if tag in BREAKDOWN}
    print(json.dumps({"system": "skyrl-0.4.0 " + ("native (FSDP + vLLM)" if native else "on arctic"),
                      "prompts": PROMPTS, "n": SAMPLES, "prompt_len": int(os.environ.get("P", 64 if smoke else 2048)),
                      "max_new": int(os.environ.get("T", 16 if smoke else 512)),
                      "step_s_steady_mean": round(sum(steady) / len(steady), 2), "steps": [round(t, 2) for t in times],
                      "steady_means": parts}), flush=True)


if __name__ == "__main__":
    main()
