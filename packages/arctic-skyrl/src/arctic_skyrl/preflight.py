"""Checks that run before SkyRL starts Ray or loads anything, so a bad run fails in seconds.

An unsupported SkyRL version, settings arctic-skyrl cannot honour, SkyRL's own config checks
(``validate_cfg``, run after these), a model folder that does not exist, backend options that the
backend does not take, prompt and response lengths past the model's positions, a server URL that
does not answer or refuses the token, a server that serves another model or no reference model for the KL:
each ends the process with one line on stderr and exit status 2.
"""

from __future__ import annotations

from arctic_core.adapters.mapping import check_supported, framework_version_problem
from arctic_core.adapters.preflight import check_backend, check_positions, check_server
from arctic_core.adapters.settings import BackendSettings
from arctic_core.errors import ArcticError
from arctic_skyrl.mapping import MAPPING, arctic_config
from arctic_skyrl.settings import ArcticSkyRLConfig, read_settings


def preflight(cfg: ArcticSkyRLConfig) -> BackendSettings:
    """The validated ``arctic`` settings; raises :class:`~arctic_core.errors.ArcticError` naming
    the first problem that would stop the run."""
    problem = framework_version_problem(MAPPING)
    if problem:
        raise ArcticError(problem)
    settings = read_settings(cfg)
    check_supported(MAPPING, cfg, settings)
    algorithm, model_path = cfg.trainer.algorithm, str(cfg.trainer.policy.model.path)
    if settings.url:
        needs = ("trainer.algorithm.use_kl_loss / use_kl_in_reward"
                 if algorithm.use_kl_loss or algorithm.use_kl_in_reward else None)
        check_server(settings, model_path, "trainer.policy.model.path", needs)
    else:
        check_backend(arctic_config(cfg, settings, on_gpu=False))
    # SkyRL's samplers take any prompt the model's positions hold (a longer one is refused when it
    # comes): only a response limit that leaves no room for even one prompt token is certain to fail.
    check_positions(model_path, cfg.generator.sampling_params.max_generate_length + 1,
                    "generator.sampling_params.max_generate_length + one prompt token")
    return settings
