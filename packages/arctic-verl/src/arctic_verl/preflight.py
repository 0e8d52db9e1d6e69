"""Checks that run in verl's driver before Ray starts, so a bad run fails in seconds.

Everything a run on Arctic needs is checked here with the messages a user can act on: settings
arctic-verl cannot honour, a model folder that does not exist, a server URL that does not answer
or refuses the token, a server that serves another model or no reference model for the KL.
A problem ends the process with one line on stderr and exit status 2, not a traceback from inside
verl's Ray actors.
"""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig

from arctic_core.client import ArcticClient
from arctic_core.errors import ArcticError
from arctic_verl.mapping import arctic_config, check_supported, get
from arctic_verl.settings import ArcticSettings, read_settings

CONNECT_TIMEOUT_S = 10.0


def check_server(config: DictConfig, settings: ArcticSettings) -> None:
    """The server at ``arctic.url`` answers, accepts the token, serves verl's model, and serves
    reference log-probs when verl's loss or reward needs them."""
    from verl.trainer.ppo.utils import need_reference_policy  # noqa: PLC0415

    client = ArcticClient.http(settings.url, token=settings.token, timeout=CONNECT_TIMEOUT_S)
    try:
        served = client.status().info.get("config", {})
    finally:
        client.close()
    served_model = str(served.get("model", {}).get("path", ""))
    model = str(get(config, "actor_rollout_ref.model.path"))
    if served_model and os.path.realpath(os.path.expanduser(served_model)) != os.path.realpath(os.path.expanduser(model)):
        raise ArcticError(f"the server at {settings.url} serves {served_model}, but actor_rollout_ref.model.path is "
                          f"{model}: verl's tokenizer and data must match the served model")
    if need_reference_policy(config) and served.get("reference") is None:
        raise ArcticError(f"verl's KL (use_kl_loss / use_kl_in_reward) needs reference log-probs, and the server at "
                          f"{settings.url} has no reference model: start it with `reference: {{}}` in its config")


def preflight(config: DictConfig) -> None:
    """Raise :class:`ArcticError` naming the first problem that would stop the run."""
    settings = read_settings(config)
    check_supported(config, settings)
    if settings.url:
        check_server(config, settings)
    elif settings.starts_backend:
        arctic_config(config, settings, on_gpu=False).check_model_folders()


def fail_fast(config: DictConfig, problem: str | None) -> None:
    """Exit with status 2 and one line naming the problem (``problem``, or what the checks find)."""
    if problem is None:
        try:
            preflight(config)
        except ArcticError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"arctic-verl: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
