"""Where a framework adapter's Arctic backend runs, and how its rollout requests are grouped.

Each adapter adds these keys to its framework's config as an ``arctic`` section (verl:
``+arctic.url=...``; SkyRL: ``arctic.url=...``). Everything else (model, optimizer, loss,
sampling) comes from the framework's own settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field, model_validator

from arctic_core.config import StrictModel


class BackendSettings(StrictModel):
    """With no ``url`` the adapter starts the backend itself, configured from the framework's
    settings plus ``config``."""

    url: str | None = None
    """An ``arctic-rl serve`` server to use (it keeps its own config); None: start one."""
    token: str | None = None
    """The server's bearer token; None reads $ARCTIC_RL_TOKEN."""
    config: dict[str, Any] = Field(default_factory=dict)
    """ArcticConfig settings for the backend the adapter starts (trainer, sampler, reference,
    weight_sync, colocate, model.dtype, ...); model path and optimizer come from the framework."""
    timeout: float = Field(600.0, gt=0)
    """Seconds one backend call may take (HTTP only)."""
    group_quiet_ms: float = Field(200.0, ge=0)
    """The rollout client gathers the framework's per-sample requests into prompt groups until none
    has come for this long (agent loops send a batch's requests one after another); 0 sends each
    request as it comes (the server runs them side by side, and its sampler prefills a prompt once
    for the calls that ask for it while it waits)..."""
    group_max_wait_ms: float = Field(5000.0, ge=0)
    """... or until this long after the first request of the gathering."""

    @model_validator(mode="after")
    def _config_only_when_started(self) -> BackendSettings:
        if not self.starts_backend and self.config:
            raise ValueError("arctic.config configures a backend the adapter starts; a server named by "
                             "arctic.url (or arctic.actor) keeps its own config")
        return self

    @property
    def starts_backend(self) -> bool:
        return not self.url


def settings_dataclass(settings: type[StrictModel], name: str, module: str, bases: tuple[type, ...] = ()) -> type:
    """A dataclass ``module.name`` with the fields and defaults of ``settings``, for a framework
    whose config is a tree of dataclasses (SkyRL's): the section parses with the framework's config,
    and its values are validated by ``settings`` itself afterwards. Fields are typed ``Any``: the
    framework passes them through as they are."""
    specs = []
    for field_name, info in settings.model_fields.items():
        if info.default_factory is not None:
            specs.append((field_name, Any, dataclasses.field(default_factory=info.default_factory)))
        else:
            specs.append((field_name, Any, dataclasses.field(default=info.default)))
    return dataclasses.make_dataclass(name, specs, bases=bases, module=module)
