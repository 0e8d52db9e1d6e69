"""The module SkyRL's ``main_base`` hands the run to: ``trainer.override_entrypoint=arctic_skyrl.entrypoint``.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=arctic_skyrl.entrypoint \\
        trainer.policy.model.path=... data.train_data=[...] [arctic.url=http://...]

It parses SkyRL's command line with the ``arctic`` section added, runs SkyRL's own config checks
and Arctic's start-up checks (one line and exit status 2 on a problem), starts Ray (SkyRL's
registries and logging live there), opens the backend (in this process, or the server at
``arctic.url``) and runs SkyRL's experiment on it. A project with its own skyrl-gym environments
registers them in its own module and calls :func:`main` from there.
"""

from __future__ import annotations

import sys

import torch
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.utils import initialize_ray

from arctic_core.adapters.preflight import describe, exit_with
from arctic_core.adapters.settings import BackendSettings
from arctic_core.client import ArcticClient
from arctic_core.errors import ArcticError
from arctic_skyrl.experiment import ArcticPPOExp
from arctic_skyrl.mapping import arctic_config
from arctic_skyrl.preflight import preflight
from arctic_skyrl.settings import ArcticSkyRLConfig

OVERRIDE = "trainer.override_entrypoint="


def parse(argv: list[str]) -> tuple[ArcticSkyRLConfig, BackendSettings]:
    """SkyRL's config from ``argv`` (without the override itself), checked by SkyRL and by Arctic."""
    cfg = ArcticSkyRLConfig.from_cli_overrides([arg for arg in argv if not arg.startswith(OVERRIDE)])
    # Settings of SkyRL's vLLM engines that would start helpers scraping engines that do not run.
    cfg.generator.inference_engine.enable_ray_prometheus_stats = False
    settings = preflight(cfg)  # first: a refused setting is named even where SkyRL's own checks would assert
    validate_cfg(cfg)
    return cfg, settings


def open_backend(cfg: ArcticSkyRLConfig, settings: BackendSettings) -> ArcticClient:
    if settings.url:
        return ArcticClient.http(settings.url, token=settings.token, timeout=settings.timeout)
    return ArcticClient.in_process(arctic_config(cfg, settings, on_gpu=torch.cuda.is_available()))


def main(argv: list[str] | None = None) -> None:
    try:
        cfg, settings = parse(sys.argv[1:] if argv is None else argv)
    except (ArcticError, ValueError, AssertionError) as exc:  # SkyRL's checks raise the last two
        exit_with("arctic-skyrl", describe(exc, "SkyRL's"))
    initialize_ray(cfg)
    arctic = open_backend(cfg, settings)
    try:
        ArcticPPOExp(cfg, settings, arctic).run()
    finally:
        if settings.starts_backend:
            arctic.shutdown()
        arctic.close()


if __name__ == "__main__":
    main()
