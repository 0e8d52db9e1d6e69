"""SkyRL's data and command line for the tests: ``main_base`` unmodified, on the CPU.

Prompt files in SkyRL's dataset format and the overrides that make SkyRL's defaults fit a 2-core
machine. Projects with their own environments register them in their own entry-point module
(:mod:`counting_env` here) and name it in ``trainer.override_entrypoint``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import adapter_suites
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from arctic_core.demo.frameworks import write_parquet  # noqa: F401 (for the tests)
from arctic_core.demo.task import CountingTask
from arctic_skyrl import example

TESTS = Path(__file__).parent


def gsm8k_rows(count: int) -> list[dict]:
    """Rows as SkyRL's ``examples/gsm8k/gsm8k_dataset.py`` writes them (skyrl-gym's gsm8k env scores them)."""
    return adapter_suites.gsm8k_rows(count, layout="skyrl")


def counting_rows(task: CountingTask, env_class: str = "counting") -> list[dict]:
    """The demo's counting task as SkyRL prompts for an environment of :mod:`counting_env`."""
    return example.counting_rows(task.problems(), env_class)


def main_base_args(model: Path, train: Path, out: Path, *, steps: int, batch: int = 2, n: int = 4,
                   response_length: int = 12, entrypoint: str = "arctic_skyrl.entrypoint",
                   extra: tuple[str, ...] = ()) -> list[str]:
    """``python -m skyrl.train.entrypoints.main_base`` with the Arctic override, GRPO, sizes for a CPU."""
    return [
        sys.executable, "-m", "skyrl.train.entrypoints.main_base",
        f"trainer.override_entrypoint={entrypoint}",
        f"data.train_data=['{train}']",
        f"trainer.policy.model.path={model}",
        f"trainer.train_batch_size={batch}", f"trainer.policy_mini_batch_size={batch}",
        "trainer.max_prompt_length=512", f"generator.sampling_params.max_generate_length={response_length}",
        f"generator.n_samples_per_prompt={n}",
        "trainer.algorithm.advantage_estimator=grpo",
        f"trainer.max_training_steps={steps}", "trainer.eval_interval=-1", "trainer.eval_before_train=false",
        f"trainer.ckpt_path={out / 'ckpts'}", f"trainer.export_path={out / 'exports'}",
        f"trainer.log_path={out / 'logs'}", "trainer.logger=tensorboard", "trainer.run_name=test",
        "trainer.enable_ray_gpu_monitor=false", "data.dataloader.num_workers=0",
        *extra,
    ]


def run_main_base(args: list[str], cwd: Path, timeout: float = 900,
                  merged: bool = False) -> subprocess.CompletedProcess:
    """The run's outputs; ``merged``: stderr into stdout, in the order they were written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "TENSORBOARD_DIR": str(cwd / "tensorboard")}
    return subprocess.run(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True, timeout=timeout)


def logged_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar SkyRL's TensorBoard logger wrote under ``folder``: tag -> step -> value."""
    scalars: dict[str, dict[int, float]] = {}
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return scalars
