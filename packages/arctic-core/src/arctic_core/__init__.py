"""Arctic RL's core: the client a framework calls, the config, the batch format, the errors and
the plugin contract. The names below are the public API; heavy ones load on first use, so
``import arctic_core`` stays cheap.

    from arctic_core import ArcticClient, ArcticConfig, RolloutBatch, hookimpl
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from arctic_core import _old_paths
from arctic_core.errors import (ArcticError, BatchError, ConfigError, PluginConflictError, PluginNotFoundError,
                                RemoteError, RequestError, WorkerError)
from arctic_core.plugins.hookspecs import hookimpl

_old_paths.install()  # modules that moved still import from their old paths, with a DeprecationWarning

if TYPE_CHECKING:
    from arctic_core.batch import RolloutBatch
    from arctic_core.client import ArcticClient, AsyncArcticClient
    from arctic_core.config import (ArcticConfig, LogProbConfig, LossTermConfig, ModelConfig, OptimizerConfig,
                                    SamplerConfig, SamplingParams, SchedulerConfig, TrainerConfig, WeightSyncConfig)
    from arctic_core.plugins.interfaces import (LogProbBackend, LossContext, LossTerm, Processor, SamplingBackend,
                                                TrainingBackend, WeightTransport)
    from arctic_core.plugins.registry import Lazy
    from arctic_core.serving.server import ArcticServer

_LAZY = {
    "RolloutBatch": "arctic_core.batch",
    "ArcticClient": "arctic_core.client",
    "AsyncArcticClient": "arctic_core.client",
    **dict.fromkeys(["ArcticConfig", "LogProbConfig", "LossTermConfig", "ModelConfig", "OptimizerConfig",
                     "SamplerConfig", "SamplingParams", "SchedulerConfig", "TrainerConfig", "WeightSyncConfig"],
                    "arctic_core.config"),
    **dict.fromkeys(["LogProbBackend", "LossContext", "LossTerm", "Processor", "SamplingBackend", "TrainingBackend",
                     "WeightTransport"], "arctic_core.plugins.interfaces"),
    "Lazy": "arctic_core.plugins.registry",
    "ArcticServer": "arctic_core.serving.server",
}

# Spelt out (not ``*_LAZY``) so that linters and type checkers see the names exported.
__all__ = ["ArcticError", "BatchError", "ConfigError", "PluginConflictError", "PluginNotFoundError", "RemoteError",
           "RequestError", "WorkerError", "hookimpl",
           "RolloutBatch", "ArcticClient", "AsyncArcticClient",
           "ArcticConfig", "LogProbConfig", "LossTermConfig", "ModelConfig", "OptimizerConfig", "SamplerConfig",
           "SamplingParams", "SchedulerConfig", "TrainerConfig", "WeightSyncConfig",
           "LogProbBackend", "LossContext", "LossTerm", "Processor", "SamplingBackend", "TrainingBackend",
           "WeightTransport", "Lazy", "ArcticServer"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'arctic_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value
