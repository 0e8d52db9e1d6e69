"""arctic-fca's plugin: registers its sampling backends through the ``arctic`` entry point."""

from __future__ import annotations

from arctic_core.hookspecs import hookimpl
from arctic_core.registry import Lazy


@hookimpl
def arctic_sampling_backends():
    return {"hf-generate": Lazy("arctic_fca.hf_sampler:HFGenerateSampler", "transformers generate(): n samples per prompt, sampling log-probs.")}
