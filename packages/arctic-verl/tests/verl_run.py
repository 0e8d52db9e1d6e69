"""verl's config, data and command line for the tests: ``main_ppo`` unmodified, on the CPU.

verl's config as Hydra composes it, parquet files in verl's own dataset format, and the overrides
that make verl's defaults fit a 2-core machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from adapter_suites import gsm8k_rows  # noqa: F401 (verl's GSM8K rows, for the tests)
from arctic_core.demo.frameworks import write_parquet  # noqa: F401 (for the tests)

VERL_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def verl_config(*overrides: str) -> DictConfig:
    """verl's ``ppo_trainer`` config, composed by Hydra as ``main_ppo`` composes it (GRPO and
    lengths within the tiny model's 512 positions unless ``overrides`` say otherwise)."""
    defaults = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "data.max_prompt_length=256", "data.max_response_length=256"]
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=[*defaults, *overrides])


def main_ppo_args(model: Path, train: Path, val: Path, out: Path, *, steps: int, batch: int = 2, n: int = 4,
                  response_length: int = 16, workers: int = 2, extra: tuple[str, ...] = ()) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the Arctic switch, GRPO, and sizes for a CPU (``workers``
    agent-loop workers: verl's default of 8 starts as many processes, slow on a 2-core machine)."""
    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "trainer.v1.trainer_mode=arctic",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}", f"data.val_files={val}",
        f"data.train_batch_size={batch}", "data.max_prompt_length=64", f"data.max_response_length={response_length}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.agent.num_workers={workers}",  # several workers share the server
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "reward.num_workers=1",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.logger=[console,tensorboard]", "trainer.val_before_train=False", "trainer.test_freq=-1",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out / 'checkpoints'}",
        "trainer.project_name=arctic", "trainer.experiment_name=test",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "+ray_kwargs.ray_init.num_cpus=8",
        *extra,
    ]


def run_main_ppo(args: list[str], cwd: Path, timeout: float = 900, merged: bool = False) -> subprocess.CompletedProcess:
    """The run's outputs; ``merged``: stderr into stdout, in the order they were written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}
    return subprocess.run(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True, timeout=timeout)


STEP_LINE = re.compile(r"step:(\d+) - (.*)$")


def logged_steps(output: str) -> dict[int, dict[str, float]]:
    """The metrics verl's console logger printed for each training step (``step:N - key:value - ...``)."""
    steps: dict[int, dict[str, float]] = {}
    for line in output.splitlines():
        match = STEP_LINE.search(line)
        if match is None:
            continue
        metrics = {}
        for item in match.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            number = re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip())
            try:
                metrics[key] = float(number)
            except ValueError:
                pass
        steps.setdefault(int(match.group(1)), {}).update(metrics)  # a step may be printed twice
    return steps
