"""Where a run in the ``arctic`` mode writes by default: under ``runs/verl/`` of the working folder.

verl's own defaults are ``outputs/<date>/<time>`` (Hydra's run folder: the composed config and the
log), ``tensorboard_log/<project>/<experiment>`` and ``checkpoints/<project>/<experiment>``: run
from a checkout, they would land beside its sources. Each moves under ``runs/verl/`` only where
the run leaves it to verl's default; a folder the run names is kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

ROOT = "runs/verl"
HYDRA_RUN_DIR = f"{ROOT}/outputs/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}"
VERL_CHECKPOINTS = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
CHECKPOINTS = f"{ROOT}/{VERL_CHECKPOINTS}"
MODE_KEY = "trainer.v1.trainer_mode"


def hydra_run_dir(argv: list[str], main_module: str | None, mode: str) -> None:
    """Add ``hydra.run.dir`` under ``runs/verl/`` to ``main_ppo``'s command line (``argv``, in
    place) when it asks for ``mode`` and names no run folder of its own. Hydra reads the command
    line when ``main()`` is called, after ``import verl`` has loaded the plugin that calls this."""
    if main_module != "verl.trainer.main_ppo" or _last_value(argv, MODE_KEY) != mode:
        return
    if _last_value(argv, "hydra.run.dir") is None:
        argv.append(f"hydra.run.dir={HYDRA_RUN_DIR}")


def main_module(orig_argv: list[str] | None = None) -> str | None:
    """The module this process runs, read from the interpreter's own command line: ``python -m
    verl.trainer.main_ppo`` imports ``verl`` (and so its plugins) before ``__main__`` exists."""
    orig_argv = sys.orig_argv if orig_argv is None else orig_argv
    if "-m" in orig_argv[1:-1]:
        return orig_argv[orig_argv.index("-m", 1) + 1]
    script = Path(orig_argv[1]) if len(orig_argv) > 1 else None
    if script is not None and script.parts[-3:] == ("verl", "trainer", "main_ppo.py"):
        return "verl.trainer.main_ppo"
    return None


def _last_value(argv: list[str], key: str) -> str | None:
    """The value Hydra takes for ``key`` from ``argv`` (its last one, ``+`` prefixes or not)."""
    values = [arg.split("=", 1)[1] for arg in argv if arg.lstrip("+").startswith(f"{key}=")]
    return values[-1] if values else None


def under_runs(config: DictConfig) -> None:
    """Checkpoints and TensorBoard logs under ``runs/verl/`` unless the run names their folders
    (``trainer.default_local_dir``, ``$TENSORBOARD_DIR``). Runs in the driver before Ray starts,
    so its workers (verl's task runner writes the logs) inherit the variable."""
    if OmegaConf.to_container(config.trainer, resolve=False).get("default_local_dir") == VERL_CHECKPOINTS:
        config.trainer.default_local_dir = CHECKPOINTS
    project, experiment = config.trainer.project_name, config.trainer.experiment_name
    os.environ.setdefault("TENSORBOARD_DIR", f"{ROOT}/tensorboard/{project}/{experiment}")
