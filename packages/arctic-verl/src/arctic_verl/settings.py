"""The ``arctic`` section a verl config may add: where the backend runs and how it is set up.

Everything else comes from verl's own settings (model, optimizer, loss, rollout). On the command
line each key needs Hydra's ``+`` (verl's schema has no ``arctic`` section), for example
``+arctic.url=http://127.0.0.1:8000`` or ``+arctic.config.trainer.options.zero_stage=3``.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from pydantic import Field, model_validator

from arctic_core.adapters.settings import BackendSettings
from arctic_core.config import validate
from arctic_core.errors import ConfigError

SECTION = "arctic"


class ArcticSettings(BackendSettings):
    """Which Arctic backend verl's trainer uses; with neither ``url`` nor ``actor`` the adapter
    starts one itself, as a Ray actor in verl's own Ray cluster."""

    actor: str | None = None
    """The name of a running Arctic server Ray actor to use (``ArcticClient.ray(config, name=...)``)."""
    num_gpus: float | None = Field(None, ge=0)
    """GPUs of the started server actor; None: one when verl's Ray cluster has GPUs, else none (CPU)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs Ray reserves for the started server actor (its compute threads)."""

    @model_validator(mode="after")
    def _one_backend(self) -> ArcticSettings:
        if self.url and self.actor:
            raise ValueError("set arctic.url or arctic.actor, not both")
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
    return validate(ArcticSettings, raw, f"'{SECTION}' section of the verl config", prefix=f"{SECTION}.")
