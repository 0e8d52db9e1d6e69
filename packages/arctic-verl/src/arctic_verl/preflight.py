"""Checks that run in verl's driver before Ray starts, so a bad run fails in seconds.

Everything a run on Arctic needs is checked here with the messages a user can act on: settings
arctic-verl cannot honour, a model folder that does not exist, backend options that the backend
does not take, prompt and response lengths past the model's positions, a server URL that does not
answer or refuses the token, a server that serves another model or no reference model for the KL.
A problem ends the process with one line on stderr and exit status 2, not a traceback from inside
verl's Ray actors.
"""

from __future__ import annotations

from omegaconf import DictConfig

from arctic_core.adapters.mapping import check_supported
from arctic_core.adapters.preflight import check_backend, check_positions, check_server, exit_with
from arctic_core.errors import ArcticError
from arctic_verl.mapping import MAPPING, arctic_config, get
from arctic_verl.settings import read_settings


def preflight(config: DictConfig) -> None:
    """Raise :class:`ArcticError` naming the first problem that would stop the run."""
    settings = read_settings(config)
    check_supported(MAPPING, config, settings)
    model_path = str(get(config, "actor_rollout_ref.model.path"))
    if settings.url:
        from verl.trainer.ppo.utils import need_reference_policy

        needs = "verl's KL (use_kl_loss / use_kl_in_reward)" if need_reference_policy(config) else None
        check_server(settings, model_path, "actor_rollout_ref.model.path", needs)
    elif settings.starts_backend:
        check_backend(arctic_config(config, settings, on_gpu=False))
    rollout = config.actor_rollout_ref.rollout
    check_positions(model_path, rollout.prompt_length + rollout.response_length,
                    "actor_rollout_ref.rollout.prompt_length + response_length (data.max_prompt_length + "
                    "data.max_response_length unless set)")


def fail_fast(config: DictConfig, problem: str | None) -> None:
    """Exit with status 2 and one line naming the problem (``problem``, or what the checks find)."""
    if problem is None:
        try:
            preflight(config)
        except ArcticError as exc:
            problem = str(exc)
    if problem is not None:
        exit_with("arctic-verl", problem)
