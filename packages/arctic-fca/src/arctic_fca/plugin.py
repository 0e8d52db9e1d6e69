"""arctic-fca's plugin: registers its sampling backends through the ``arctic`` entry point."""

from __future__ import annotations

from arctic_core import Lazy, hookimpl


@hookimpl
def arctic_sampling_backends():
    return {
        "embedded": Lazy("arctic_fca.embedded_sampler:EmbeddedSampler",
                         "Embedded engine: continuous batching, paged KV with prefix sharing, FCA decode.",
                         options="arctic_fca.engine:EngineOptions"),
        "hf-generate": Lazy("arctic_fca.hf_sampler:HFGenerateSampler",
                            "transformers generate(): n samples per prompt, sampling log-probs.",
                            options="arctic_fca.hf_sampler:HFSamplerOptions"),
        "vllm": Lazy("arctic_fca.vllm.sampler:VllmSampler",
                     "vLLM 0.24.x: prefix caching, in-place weight updates, sleep mode (the 'vllm' extra).",
                     options="arctic_fca.vllm.sampler:VllmOptions", needs="arctic-fca[vllm]"),
    }
