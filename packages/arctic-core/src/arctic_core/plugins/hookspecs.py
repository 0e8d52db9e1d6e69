"""The plugin contract: every hook an Arctic plugin may implement.

A plugin is an ordinary module with ``@hookimpl`` functions, advertised through the ``arctic``
entry-point group (``[project.entry-points.arctic] myname = "my_package.my_module"``). The core
never imports a plugin by name; the built-ins in :mod:`arctic_core.plugins.builtins`,
``arctic_zorro`` and ``arctic_fca`` register exactly the way a third party does.

Every hook is a *provider* hook: the registry calls it once, when it is built, and the hook
returns ``{name: factory}``. The answers of all plugins are merged (none is ``firstresult``); two
plugins that provide one name for the same kind are an error, since names are global per kind.
Users then pick a provider by name in the config (``trainer.backend: deepspeed``,
``loss: [{name: ppo}]``). Each hook's factory type below says what a factory takes and returns;
:mod:`arctic_core.plugins.interfaces` says what the product must do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from arctic_core.config import LogProbConfig, ModelConfig, SamplerConfig, TrainerConfig, WeightSyncConfig
    from arctic_core.plugins.interfaces import (LogProbBackend, LossTerm, Processor, SamplingBackend,
                                                TrainingBackend, WeightTransport)

PROJECT = "arctic"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

PROVIDER_HOOKS: dict[str, str] = {}
"""Plugin kind (``"training_backend"``, ``"loss"``, ...) -> the name of the hook that provides it."""


def provides[F: Callable[..., Any]](kind: str) -> Callable[[F], F]:
    """Declare a provider hook for ``kind`` (registered as a pluggy hookspec)."""

    def mark(hook: F) -> F:
        PROVIDER_HOOKS[kind] = hook.__name__
        return hookspec(hook)

    return mark


# ----------------------------------------------------------------- what the factories look like
class TrainingBackendFactory(Protocol):
    def __call__(self, config: TrainerConfig, model: ModelConfig, *, seed: int) -> TrainingBackend: ...


class LogProbBackendFactory(Protocol):
    def __call__(self, config: LogProbConfig, model: ModelConfig, *, seed: int) -> LogProbBackend: ...


class SamplingBackendFactory(Protocol):
    def __call__(self, config: SamplerConfig, model: ModelConfig, *, seed: int) -> SamplingBackend: ...


class ProcessorFactory(Protocol):
    def __call__(self, *, temperature: float) -> Processor: ...


class LossFactory(Protocol):
    def __call__(self, **options: Any) -> LossTerm: ...


class WeightTransportFactory(Protocol):
    def __call__(self, config: WeightSyncConfig) -> WeightTransport: ...


# ----------------------------------------------------------------- the hooks
@provides("training_backend")
def arctic_training_backends() -> Mapping[str, TrainingBackendFactory]:
    """Training backends: the policy's forward/backward with a loss, optimizer step, log-probs of
    the current weights, weight export, checkpoints, sleep/wake.

    :return: ``{name: factory}``; the server calls ``factory(config.trainer, config.model,
        seed=config.seed)`` once, for the backend ``trainer.backend`` names. The factory validates
        ``config.options`` itself (:func:`arctic_core.config.validate_options`).
    """


@provides("logprob_backend")
def arctic_logprob_backends() -> Mapping[str, LogProbBackendFactory]:
    """Forward-only log-prob backends (the frozen reference model of a KL penalty).

    :return: ``{name: factory}``; the server calls ``factory(config.reference, model,
        seed=config.seed)`` where ``model`` is ``reference.model`` or else the policy's.
    """


@provides("sampling_backend")
def arctic_sampling_backends() -> Mapping[str, SamplingBackendFactory]:
    """Sampling backends: ``n`` responses per prompt with sampling log-probs, in-place weight
    updates stamped with a policy version, sleep/wake.

    :return: ``{name: factory}``; the server calls ``factory(config.sampler, config.model,
        seed=config.seed)``.
    """


@provides("processor")
def arctic_processors() -> Mapping[str, ProcessorFactory]:
    """Processors: logits at response positions -> per-token outputs (log-probs at a temperature,
    entropy, ...). A loss term names the processors whose outputs it needs (``requires``, by their
    registered names); the server builds them for every ``log_probs`` and ``fwd_bwd`` call.

    :return: ``{name: factory}``; ``factory(temperature=t)`` is called once per request.
    """


@provides("loss")
def arctic_losses() -> Mapping[str, LossFactory]:
    """Loss terms. A ``fwd_bwd`` combines several (``ppo`` + ``kl`` + ``entropy``), each with its
    weight and options.

    :return: ``{name: factory}``; ``factory(**options)`` is called once per request with the
        term's options (everything in ``{name: ..., weight: ..., <options>}`` but name and weight);
        it should refuse unknown options with a :class:`~arctic_core.errors.ConfigError`.
    """


@provides("weight_transport")
def arctic_weight_transports() -> Mapping[str, WeightTransportFactory]:
    """Weight-sync transports, trainer -> samplers.

    :return: ``{name: factory}``; the server calls ``factory(config.weight_sync)`` once, for the
        transport ``weight_sync.transport`` names.
    """
