"""arctic-fca's plugin: registers its sampling backends through the ``arctic`` entry point."""

from __future__ import annotations

from arctic_core.hookspecs import hookimpl
from arctic_fca.hf_sampler import HFGenerateSampler


@hookimpl
def arctic_sampling_backends():
    return {"hf-generate": HFGenerateSampler}
