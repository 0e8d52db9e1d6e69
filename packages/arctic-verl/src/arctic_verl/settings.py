"""The ``arctic`` section a verl config may add: where the backend runs and how it is set up.

Everything else comes from verl's own settings (model, optimizer, loss, rollout). On the command
line each key needs Hydra's ``+`` (verl's schema has no ``arctic`` section), for example
``+arctic.url=http://127.0.0.1:8000`` or ``+arctic.config.trainer.options.zero_stage=3``.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import Field, model_validator

from arctic_core.config import StrictModel, validate
from arctic_core.errors import ConfigError

SECTION = "arctic"


class ArcticSettings(StrictModel):
    """Which Arctic backend verl's trainer uses; with neither ``url`` nor ``actor`` the adapter
    starts one itself, as a Ray actor in verl's own Ray cluster."""

    url: str | None = None
    """An ``arctic-rl serve`` server to use (it keeps its own config); None: start one."""
    token: str | None = None
    """The server's bearer token; None reads $ARCTIC_RL_TOKEN."""
    actor: str | None = None
    """The name of a running Arctic server Ray actor to use (``ArcticClient.ray(config, name=...)``)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """ArcticConfig settings for the backend the adapter starts (trainer, sampler, reference,
    weight_sync, colocate, model.dtype, ...); model path, optimizer and reference come from verl."""
    num_gpus: float | None = Field(None, ge=0)
    """GPUs of the started server actor; None: one when verl's Ray cluster has GPUs, else none (CPU)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs Ray reserves for the started server actor (its compute threads)."""
    timeout: float = Field(600.0, gt=0)
    """Seconds one backend call may take (HTTP only)."""
    group_quiet_ms: float = Field(200.0, ge=0)
    """The rollout client gathers verl's per-sample requests into prompt groups until none has
    come for this long (verl's agent loop sends a batch's requests one after another)..."""
    group_max_wait_ms: float = Field(5000.0, ge=0)
    """... or until this long after the first request of the gathering."""

    @model_validator(mode="after")
    def _one_backend(self) -> ArcticSettings:
        if self.url and self.actor:
            raise ValueError("set arctic.url or arctic.actor, not both")
        if (self.url or self.actor) and self.config:
            raise ValueError("arctic.config configures a backend the adapter starts; a server named by "
                             "arctic.url or arctic.actor keeps its own config")
        return self

    @property
    def starts_backend(self) -> bool:
        return not (self.url or self.actor)


def read_settings(config: DictConfig) -> ArcticSettings:
    """The ``arctic`` section of verl's config, validated (defaults when it is absent)."""
    section = OmegaConf.select(config, SECTION, default=None)
    raw = OmegaConf.to_container(section, resolve=True) if section is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the '{SECTION}' section of the verl config must be a mapping, got {raw!r}")
    return validate(ArcticSettings, raw, f"the '{SECTION}' section of the verl config", prefix=f"{SECTION}.")
