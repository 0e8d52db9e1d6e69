"""The plugin API: every name a plugin may import, all from here::

    from arctic_core.plugins import LossContext, RolloutBatch, aggregate, hookimpl

These names, the six provider hooks of :mod:`~arctic_core.plugins.hookspecs` and the ``arctic``
entry-point group are the surface a plugin can rely on. ``PLUGIN_API_VERSION`` is major.minor:
the minor moves when names are added, the major when one is removed or changes so that a plugin
written against it breaks. A name or module that moves keeps working at its old path, with a
DeprecationWarning, for at least one minor release of arctic-core (docs/design/plugin-system.md).

The submodules are the plugin system itself: the hook contract (``hookspecs``), what each product
must do (``interfaces``), discovery by entry point (``registry``), config checks (``checks``) and the
core's own plugin (``builtins``). Names load on first use, so a plugin module that imports only
``hookimpl`` and ``Lazy`` stays light (no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

PLUGIN_API_VERSION = "1.1"
"""1.0: arctic-core 0.1.0 (hooks in ``arctic_core.hookspecs``, protocols in ``arctic_core.interfaces``).
1.1: this module; typed factory protocols; ``Lazy`` options and needs; tensor metrics."""

_HOOKSPECS = "arctic_core.plugins.hookspecs"
_INTERFACES = "arctic_core.plugins.interfaces"

API: dict[str, str] = {
    # the hooks: mark, factory types, lazy factories, entry-point group
    "hookimpl": _HOOKSPECS,
    **dict.fromkeys(["TrainingBackendFactory", "LogProbBackendFactory", "SamplingBackendFactory",
                     "ProcessorFactory", "LossFactory", "WeightTransportFactory"], _HOOKSPECS),
    "Lazy": "arctic_core.plugins.registry",
    "ENTRY_POINT_GROUP": "arctic_core.plugins.registry",
    # what the products must do, and what they receive
    **dict.fromkeys(["TrainingBackend", "LogProbBackend", "SamplingBackend", "Processor", "LossTerm",
                     "WeightTransport", "WeightReceiver", "Objective", "LossContext", "Metrics", "NamedTensors"],
                    _INTERFACES),
    "RolloutBatch": "arctic_core.batch",
    **dict.fromkeys(["ModelConfig", "TrainerConfig", "LogProbConfig", "SamplerConfig", "WeightSyncConfig",
                     "SamplingParams", "StrictModel", "validate", "validate_options"], "arctic_core.config"),
    # helpers for loss terms, and the errors a product raises
    **dict.fromkeys(["aggregate", "token_mean", "extreme"], "arctic_core.losses.aggregation"),
    **dict.fromkeys(["ArcticError", "BatchError", "ConfigError", "RequestError"], "arctic_core.errors"),
}
"""Each name of the plugin API -> the module that defines it."""

__all__ = ["PLUGIN_API_VERSION", *API]


def __getattr__(name: str) -> Any:
    module = API.get(name)
    if module is None:
        raise AttributeError(f"module 'arctic_core.plugins' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *API})
