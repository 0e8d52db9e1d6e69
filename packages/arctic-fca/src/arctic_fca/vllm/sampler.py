"""The ``vllm`` sampling backend: vLLM 0.24.x behind the sampling hookspec
(``pip install 'arctic-fca[vllm]'``; other vLLM versions are refused by name).

Token ids in, token ids and sampling log-probs out (``logprobs=0`` returns exactly the sampled
token's log-prob; ``processed_logprobs`` makes it the log-prob of the distribution actually sampled
from, after temperature and top-k/top-p), ``n`` samples per prompt, prefix caching on. Weights from
the trainer go into the running engine without a restart: CUDA tensors as IPC handles
(:mod:`arctic_core.weights.ipc`), CPU tensors as they are, through ``collective_rpc`` into the worker
extension :class:`arctic_fca.vllm.worker.ArcticWorkerExtension`; the prefix cache is reset after every
update, so no result mixes KV of two policies. Sleep/wake use vLLM's sleep mode (level 1: weights
offloaded to the host, KV cache freed).

Decode attention is FCA (``arctic_fca.vllm.attention``, vLLM's CUSTOM backend) unless ``fca: false``.

``sampler: {backend: vllm, options: {gpu_memory_utilization: 0.5, fca: true, engine_args: {...}}}``.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Literal

from pydantic import Field

from arctic_core.batch import RolloutBatch
from arctic_core.config import ModelConfig, SamplerConfig, SamplingParams, StrictModel, validate_options
from arctic_core.errors import ConfigError, engine_asleep
from arctic_core.hf import check_prompts
from arctic_core.plugins.interfaces import NamedTensors

SUPPORTED_VERSION = "0.24."
WORKER_EXTENSION = "arctic_fca.vllm.worker.ArcticWorkerExtension"


class VllmOptions(StrictModel):
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Share of the GPU vLLM may take.")
    max_model_len: int | None = Field(None, gt=0, description="Longest prompt + response; None: the model's.")
    enforce_eager: bool = Field(False, description="No CUDA graphs (faster start, slower decode).")
    bucket_bytes: int = Field(256 * 2**20, gt=0, description="Weight-update bucket size (one IPC handle each).")
    fca: bool = Field(True, description="Decode with FCA (our vLLM attention backend) instead of FlashAttention.")
    fca_base: Literal["FLASH_ATTN", "TRITON_ATTN"] = Field(
        "FLASH_ATTN", description="The vLLM backend FCA extends (prefill, mixed batches); TRITON_ATTN also runs fp32.")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="Any other vllm.LLM argument.")


def import_vllm() -> Any:
    """vLLM, if it is the supported release; else a ConfigError that says what to install."""
    try:
        import vllm
    except ImportError:
        raise ConfigError("sampler backend 'vllm' needs vLLM 0.24.x: pip install 'arctic-fca[vllm]'") from None
    if not vllm.__version__.startswith(SUPPORTED_VERSION):
        raise ConfigError(f"sampler backend 'vllm' supports vLLM {SUPPORTED_VERSION}x; this environment has "
                          f"{vllm.__version__}")
    return vllm


class VllmSampler:
    options_model = VllmOptions

    def __init__(self, config: SamplerConfig, model: ModelConfig, *, seed: int) -> None:
        self.options = validate_options(self.options_model, config, "vllm")
        self.vllm = import_vllm()
        dtype = "auto" if model.dtype == "auto" else model.dtype
        self.llm = self.vllm.LLM(
            model=model.path, dtype=dtype, seed=seed, enable_prefix_caching=True, skip_tokenizer_init=True,
            gpu_memory_utilization=self.options.gpu_memory_utilization, max_model_len=self.options.max_model_len,
            enforce_eager=self.options.enforce_eager, enable_sleep_mode=True, logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION, **self._attention(), **self.options.engine_args,
        )
        # FCA builders given the host's block tables, per worker (they exist once the engine is up)
        self.fca_host_views = self.llm.collective_rpc("arctic_fca_attach_host_tables") if self.options.fca else None
        self.policy_version = 0
        self.asleep = False

    def _attention(self) -> dict[str, Any]:
        """FCA is vLLM's CUSTOM backend, registered by our ``vllm.general_plugins`` entry point."""
        if not self.options.fca or "attention_config" in self.options.engine_args:
            return {}
        from arctic_fca.vllm.plugin import BASE_ENV

        os.environ[BASE_ENV] = self.options.fca_base  # read by the plugin in vLLM's processes
        return {"attention_config": {"backend": "CUSTOM"}}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        if self.asleep:
            raise engine_asleep("sampler")
        model = self.llm.llm_engine.model_config  # refused here by name, not deep inside vLLM
        check_prompts(prompts, model.get_vocab_size(), params, model.max_model_len)
        # vLLM refuses greedy decoding with n > 1; the n greedy samples are one sequence repeated.
        copies = params.n if params.greedy else 1
        sampling = self.vllm.SamplingParams(
            n=params.n // copies, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            min_p=params.min_p, repetition_penalty=params.repetition_penalty,
            max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids or None, seed=params.seed,
            ignore_eos=params.ignore_eos,
            logprobs=0, detokenize=False,
        )
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        responses, index, logprobs = [], [], []
        for prompt, output in enumerate(outputs):  # vLLM keeps the prompts' order
            for sample in sorted(output.outputs, key=lambda s: s.index) * copies:
                tokens = list(sample.token_ids)
                responses.append(tokens)
                index.append(prompt)
                logprobs.append([step[token].logprob for step, token in zip(sample.logprobs, tokens, strict=True)])
        return RolloutBatch.from_samples(prompts, responses, index, logprobs, self.policy_version)

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        named = [(name, tensor.detach()) for name, tensor in weights]
        if named and named[0][1].is_cuda:
            from arctic_core.weights.ipc import export_cuda_ipc

            payload, buffers = export_cuda_ipc(named, self.options.bucket_bytes, version)
            self.llm.collective_rpc("import_weights_ipc", args=(payload,))
            del buffers  # every worker has copied (collective_rpc returns when they all have)
        else:
            self.llm.collective_rpc("arctic_load_tensors", args=({name: t.contiguous() for name, t in named},))
        self.llm.reset_prefix_cache()  # cached KV belongs to the old policy
        self.policy_version = version

    def fca_stats(self) -> dict[str, int]:
        """How FCA's batches and work builds went so far, summed over the workers (empty without
        FCA): see ``ArcticWorkerExtension.arctic_fca_stats``."""
        totals: Counter[str] = Counter()
        for stats in self.llm.collective_rpc("arctic_fca_stats") if self.options.fca else []:
            totals.update(stats)
        return dict(totals)

    def sleep(self) -> None:
        self.llm.sleep(level=1)
        self.asleep = True

    def wake(self) -> None:
        self.llm.wake_up()
        self.asleep = False

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        self.asleep = True
