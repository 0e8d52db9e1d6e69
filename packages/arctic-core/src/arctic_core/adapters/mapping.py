"""What a framework adapter declares about its framework, and the checks and conversions done over it.

An adapter's mapping says which framework releases it supports, which of the framework's settings
it cannot honour (each as ``key=value: why``), the loss terms the framework's settings mean, what
the framework's settings say about the backend (model, optimizer, reference model, seed), and
which of the framework's metric names are Arctic metrics under another name. The functions here
do the rest the same way for every adapter: the version check, the refusal message, the backend
config with the user's ``arctic.config`` laid over it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from arctic_core.adapters.preflight import version_problem
from arctic_core.adapters.settings import BackendSettings
from arctic_core.adapters.translation import overlay
from arctic_core.config import ArcticConfig
from arctic_core.errors import ConfigError

FrameworkConfig = TypeVar("FrameworkConfig", contravariant=True)

# The keys of ``arctic.config`` a framework's own settings set: the user changes them there.
FRAMEWORK_OWNED = {"model": ("path",), "trainer": ("optimizer", "scheduler", "gradient_checkpointing")}


@dataclass(frozen=True)
class BackendInputs:
    """What a framework's settings say about the backend an adapter starts."""

    model_path: str
    optimizer: dict[str, Any]
    """ArcticConfig's ``trainer.optimizer`` (lr, betas, weight_decay, max_grad_norm, ...)."""
    dtype: str = "float32"
    device: str | None = None
    """None leaves the device to the backend (a GPU when there is one)."""
    gradient_checkpointing: bool = False
    reference: bool = False
    """Whether the framework's loss or reward needs the reference model's log-probs."""
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Further ArcticConfig settings the framework's own settings imply, laid over the rest."""

    def config(self) -> dict[str, Any]:
        base: dict[str, Any] = {
            "model": {"path": self.model_path, "dtype": self.dtype, **({"device": self.device} if self.device else {})},
            "trainer": {"optimizer": self.optimizer, "gradient_checkpointing": self.gradient_checkpointing},
            "reference": {} if self.reference else None,
        }
        if self.seed is not None:
            base["seed"] = self.seed
        return overlay(base, self.extra)


def placement(on_gpu: bool) -> dict[str, str]:
    """The model's dtype and device for a backend started on a GPU (bf16) or on the CPU (fp32)."""
    return {"dtype": "bfloat16", "device": "cuda"} if on_gpu else {"dtype": "float32", "device": "cpu"}


class FrameworkMapping(Protocol[FrameworkConfig]):
    """One framework's settings in Arctic's terms (an adapter's ``mapping`` module provides one)."""

    adapter: str
    """The adapter's name in messages: ``arctic-verl``."""
    framework: str
    """The framework's distribution name: ``verl``."""
    supported: tuple[str, str]
    """The framework releases the adapter is tested with: ``(minimum, below)``."""
    owner: str
    """Where the framework's own config sets the keys of FRAMEWORK_OWNED, for the refusal message."""
    metric_names: Mapping[str, str]
    """The framework's metric names that are Arctic's (``{term}/{metric}`` keys) under another name."""

    def refusals(self, config: FrameworkConfig, settings: BackendSettings) -> list[str]:
        """Every framework setting the adapter cannot honour exactly, each as ``key=value: why``."""
        ...

    def loss_terms(self, config: FrameworkConfig) -> list[dict[str, Any]]:
        """The framework's loss as Arctic loss terms."""
        ...

    def backend_inputs(self, config: FrameworkConfig, on_gpu: bool) -> BackendInputs:
        """What the framework's settings say about the backend."""
        ...


def framework_version_problem(mapping: FrameworkMapping) -> str | None:
    """Why the installed framework is not one the adapter supports (None when it is)."""
    return version_problem(mapping.adapter, mapping.framework, *mapping.supported)


def owned_key_refusals(mapping: FrameworkMapping, settings: BackendSettings) -> list[str]:
    """``arctic.config`` keys the framework's own settings set (they would be silently overridden
    one way or the other)."""
    return [f"arctic.config.{section}.{key}: set by {mapping.owner}"
            for section, keys in FRAMEWORK_OWNED.items() for key in keys if key in settings.config.get(section, {})]


def check_supported[Config](mapping: FrameworkMapping[Config], config: Config,
                            settings: BackendSettings) -> None:
    """Raise a ConfigError naming every setting the adapter cannot honour, if any (one problem: one line)."""
    problems = mapping.refusals(config, settings) + owned_key_refusals(mapping, settings)
    if len(problems) == 1:
        raise ConfigError(f"{mapping.adapter} cannot honour this {mapping.framework} setting: {problems[0]}")
    if problems:
        raise ConfigError(f"{mapping.adapter} cannot honour these {mapping.framework} settings:\n  "
                          + "\n  ".join(problems))


def backend_config[Config](mapping: FrameworkMapping[Config], config: Config, settings: BackendSettings,
                           on_gpu: bool) -> ArcticConfig:
    """The backend an adapter starts: the framework's model and optimizer, Arctic's engines, with the
    user's ``arctic.config`` laid over them."""
    return ArcticConfig.from_dict(overlay(mapping.backend_inputs(config, on_gpu).config(), settings.config))
