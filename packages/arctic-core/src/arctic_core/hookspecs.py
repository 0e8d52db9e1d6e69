"""The plugin contract: every hook an Arctic plugin may implement.

A plugin is an ordinary module with ``@hookimpl`` functions, advertised through the ``arctic``
entry-point group (``[project.entry-points.arctic] myname = "my_package.my_module"``). The core
never imports a plugin by name; the built-ins in :mod:`arctic_core.builtins`, ``arctic_zorro`` and
``arctic_fca`` register exactly the same way a third party does.

Each hook below is a *provider* hook: it is called once, when the registry is built, and returns a
mapping ``{name: factory}``. The registry merges the answers of all plugins; two plugins that
provide the same name for the same kind are an error (names are global per kind). Users then
select a provider by name in the config (``trainer.backend: reference``, ``loss: [{name: ppo}]``).

The interfaces that the factories' products must satisfy are the protocols in
:mod:`arctic_core.interfaces`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pluggy

PROJECT = "arctic"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def arctic_training_backends() -> Mapping[str, Callable[..., Any]]:
    """Training backends this plugin provides.

    Returns ``{name: factory}``; ``factory(config: TrainerConfig, model: ModelConfig, *, seed: int)`` builds an
    object satisfying :class:`arctic_core.interfaces.TrainingBackend` (forward/backward with a
    loss, optimizer step, log-probs of the current policy, weight export, checkpoints,
    sleep/wake). All plugins' answers are merged.
    """


@hookspec
def arctic_logprob_backends() -> Mapping[str, Callable[..., Any]]:
    """Forward-only log-prob backends this plugin provides (e.g. for a frozen reference model).

    Returns ``{name: factory}``; ``factory(config: LogProbConfig, model: ModelConfig, *, seed: int)`` builds an
    object satisfying :class:`arctic_core.interfaces.LogProbBackend`. All answers are merged.
    """


@hookspec
def arctic_sampling_backends() -> Mapping[str, Callable[..., Any]]:
    """Sampling (generation) backends this plugin provides.

    Returns ``{name: factory}``; ``factory(config: SamplerConfig, model: ModelConfig, *, seed: int)`` builds an
    object satisfying :class:`arctic_core.interfaces.SamplingBackend` (n samples per prompt,
    sampling log-probs, in-place weight updates with a policy version). All answers are merged.
    """


@hookspec
def arctic_processors() -> Mapping[str, Callable[..., Any]]:
    """Post-forward processors this plugin provides.

    A processor turns the logits at response positions into per-token outputs (log-probs at a
    temperature, entropy, ...). Returns ``{name: factory}``; ``factory(**options)`` builds an
    object satisfying :class:`arctic_core.interfaces.Processor`. All answers are merged.
    """


@hookspec
def arctic_losses() -> Mapping[str, Callable[..., Any]]:
    """Loss terms this plugin provides.

    Returns ``{name: factory}``; ``factory(**options)`` builds an object satisfying
    :class:`arctic_core.interfaces.LossTerm`. A training call may combine several terms
    (e.g. ``ppo`` + ``kl`` + ``entropy``), each with its own options. All answers are merged.
    """


@hookspec
def arctic_weight_transports() -> Mapping[str, Callable[..., Any]]:
    """Weight-sync transports (trainer -> samplers) this plugin provides.

    Returns ``{name: factory}``; ``factory(config: WeightSyncConfig)`` builds an object satisfying
    :class:`arctic_core.interfaces.WeightTransport`. All answers are merged.
    """
