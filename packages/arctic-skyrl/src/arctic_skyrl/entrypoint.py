"""The module SkyRL's ``main_base`` hands the run to: ``trainer.override_entrypoint=arctic_skyrl.entrypoint``.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=arctic_skyrl.entrypoint \\
        trainer.policy.model.path=... data.train_data=[...] [arctic.url=http://...]

It parses SkyRL's command line with the ``arctic`` section added, runs SkyRL's own config checks
and Arctic's start-up checks (one line and exit status 2 on a problem), starts Ray (SkyRL's
registries and logging live there), opens the backend (in this process, or the server at
``arctic.url``) and runs SkyRL's experiment on it; a run whose server at ``arctic.url`` goes away
ends on a line naming the server. A project with its own skyrl-gym environments
registers them in its own module and calls :func:`main` from there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.utils import initialize_ray

from arctic_core.adapters.backend import open_backend
from arctic_core.adapters.lost_server import end_if_server_lost
from arctic_core.adapters.preflight import describe, exit_with
from arctic_core.adapters.settings import BackendSettings
from arctic_core.errors import ArcticError
from arctic_core.ray.actors import ray_environment
from arctic_skyrl.experiment import ArcticPPOExp
from arctic_skyrl.mapping import arctic_config
from arctic_skyrl.preflight import preflight
from arctic_skyrl.settings import ArcticSkyRLConfig

OVERRIDE = "trainer.override_entrypoint="
NAME = "arctic-skyrl"


def parse(argv: list[str]) -> tuple[ArcticSkyRLConfig, BackendSettings]:
    """SkyRL's config from ``argv`` (without the override itself), checked by SkyRL and by Arctic."""
    cfg = ArcticSkyRLConfig.from_cli_overrides([arg for arg in argv if not arg.startswith(OVERRIDE)])
    # Settings of SkyRL's vLLM engines that would start helpers scraping engines that do not run.
    cfg.generator.inference_engine.enable_ray_prometheus_stats = False
    settings = preflight(cfg)  # first: a refused setting is named even where SkyRL's own checks would assert
    validate_cfg(cfg)
    return cfg, settings


def start_ray(cfg: ArcticSkyRLConfig) -> None:
    """SkyRL's Ray, with two of SkyRL's defaults changed before it starts:

    - Ray workers run this interpreter and checkout as they are: under ``uv run``, Ray's uv
      integration would have every worker sync (and build) its own copy of the environment first;
    - SkyRL's TensorBoard logger, which writes to ``$TENSORBOARD_DIR``, else to ``tensorboard_log/``
      of the working folder, writes under ``runs/skyrl/`` unless the variable is set."""
    ray_environment()
    os.environ.setdefault("TENSORBOARD_DIR", str(tensorboard_dir(cfg)))
    initialize_ray(cfg)


def tensorboard_dir(cfg: ArcticSkyRLConfig) -> Path:
    return Path("runs", "skyrl", "tensorboard", cfg.trainer.project_name, cfg.trainer.run_name)


def main(argv: list[str] | None = None) -> None:
    try:
        cfg, settings = parse(sys.argv[1:] if argv is None else argv)
    except (ArcticError, ValueError, AssertionError) as exc:  # SkyRL's checks raise the last two
        exit_with(NAME, describe(exc, "SkyRL's"))
    start_ray(cfg)
    arctic, _ = open_backend(settings, lambda: arctic_config(cfg, settings, on_gpu=torch.cuda.is_available()))
    try:
        ArcticPPOExp(cfg, settings, arctic).run()
    except Exception:
        # A server on arctic.url that went away fails SkyRL's generator or trainer with their own
        # words: the run ends on a line naming the server instead.
        end_if_server_lost(NAME, settings, "rerun to resume from the last checkpoint")
        raise
    finally:
        if settings.starts_backend:
            arctic.shutdown()
        arctic.close()


if __name__ == "__main__":
    main()
