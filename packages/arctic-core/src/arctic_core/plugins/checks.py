"""A config's plugins checked before any engine is built: every plugin it names is registered, has
the optional packages it needs installed, and takes the options it is given. A misspelt option or
a missing package then fails in seconds, before the first engine spends minutes loading (and, in an
adapter, before its framework starts Ray)."""

from __future__ import annotations

from typing import Any

from arctic_core.config import ArcticConfig, validate
from arctic_core.errors import ConfigError
from arctic_core.plugins.registry import Registry

ENGINE_KINDS = {"trainer": "training_backend", "sampler": "sampling_backend", "reference": "logprob_backend"}


def check_plugins(config: ArcticConfig, registry: Registry) -> None:
    """Raise :class:`~arctic_core.errors.ConfigError` (or ``PluginNotFoundError``) naming the first
    unknown plugin or bad option. A lazy product that names no options model
    (:class:`~arctic_core.plugins.registry.Lazy` without ``options``) has its options checked when
    it is built instead: finding its model would import its engine."""
    for section, kind in ENGINE_KINDS.items():
        engine = getattr(config, section)
        if engine is not None:
            _check_options(registry, kind, engine.backend, engine.options, f"{section}.options")
    transport = registry.provided("weight_transport", config.weight_sync.transport)
    transport.check_installed()
    model = transport.options_model()
    if model is not None:
        config.weight_sync.checked_options(model)


def _check_options(registry: Registry, kind: str, name: str, options: dict[str, Any], path: str) -> None:
    provided = registry.provided(kind, name)
    provided.check_installed()
    model = provided.options_model()
    if model is None:
        return
    checked = validate(model, options, f"{path} of backend {name!r}", prefix=f"{path}.")
    from arctic_core.ray.actors import InnerBackendOptions  # imports no Ray

    if isinstance(checked, InnerBackendOptions):  # a Ray backend: the backend its actors run
        if checked.backend == name:
            raise ConfigError(f"{path}.backend: the {name} backend cannot run itself in its actors; name the "
                              "backend they run")
        _check_options(registry, kind, checked.backend, checked.options, f"{path}.options")
