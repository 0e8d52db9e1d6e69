"""arctic-zorro's plugin: registers its training and log-prob backends through the ``arctic`` entry point."""

from __future__ import annotations

from arctic_core.hookspecs import hookimpl
from arctic_zorro.reference import ReferenceLogProbEngine, ReferenceTrainer


@hookimpl
def arctic_training_backends():
    return {"reference": ReferenceTrainer}


@hookimpl
def arctic_logprob_backends():
    return {"reference": ReferenceLogProbEngine}
