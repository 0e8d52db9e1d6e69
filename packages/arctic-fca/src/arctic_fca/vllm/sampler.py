"""The ``vllm`` sampling backend: vLLM 0.24.x behind the sampling hookspec
(``pip install 'arctic-fca[vllm]'``; other vLLM versions are refused by name).

vLLM's ``AsyncLLM`` on an event loop of its own (:mod:`arctic_fca.vllm.event_loop`): generate calls
from any number of threads go into vLLM's running batch at its next step (``submit``), and a
cancelled call aborts its requests, which frees their KV blocks.

Token ids in, token ids and sampling log-probs out (``logprobs=0`` returns exactly the sampled
token's log-prob; ``processed_logprobs`` makes it the log-prob of the distribution actually sampled
from, after temperature and top-k/top-p), ``n`` samples per prompt, prefix caching on. Weights from
the trainer go into the running engine without a restart: CUDA tensors as IPC handles
(:mod:`arctic_core.weights.ipc`), CPU tensors as they are, through ``collective_rpc`` into the worker
extension :class:`arctic_fca.vllm.worker.ArcticWorkerExtension`; the prefix cache is reset after every
update. An update while requests are in flight pauses vLLM at a step boundary (``pause_generation``,
mode ``keep``), loads the weights, drops every cached block (requests in flight are recomputed under
the new weights: vLLM's cache holds one policy) and resumes; each token reports the policy version
that drew it. Sleep/wake use vLLM's sleep mode (level 1: weights
offloaded to the host, KV cache freed).

Decode attention is FCA (``arctic_fca.vllm.attention``, vLLM's CUSTOM backend) unless ``fca: false``.

``sampler: {backend: vllm, options: {gpu_memory_utilization: 0.5, fca: true, engine_args: {...}}}``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import Counter
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from arctic_core.batch import RolloutBatch
from arctic_core.config import ModelConfig, SamplerConfig, SamplingParams, StrictModel, validate_options
from arctic_core.errors import ConfigError, RequestCancelled, engine_asleep
from arctic_core.hf import check_prompts
from arctic_core.plugins.interfaces import NamedTensors
from arctic_fca.vllm.event_loop import LoopThread

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
        self.policy_version = 0
        self.asleep = False
        self._live: set[VllmCall] = set()  # calls in vLLM's batch; touched on the loop only
        self._request_ids = itertools.count()
        self._scheduler: Any = None  # vLLM's latest SchedulerStats: running, waiting, KV use
        self._preempted = 0
        self.loop = LoopThread("arctic-vllm")
        try:
            self.engine = self.loop.run(self._start(self._engine_args(model, seed)))
        except BaseException:
            self.loop.close()  # no thread left behind by an engine that did not start
            raise
        # FCA builders given the host's block tables, per worker (they exist once the engine is up)
        self.fca_host_views = self._rpc("arctic_fca_attach_host_tables") if self.options.fca else None

    def _engine_args(self, model: ModelConfig, seed: int) -> Any:
        dtype = "auto" if model.dtype == "auto" else model.dtype
        return self.vllm.AsyncEngineArgs(
            model=model.path, dtype=dtype, seed=seed, enable_prefix_caching=True, skip_tokenizer_init=True,
            gpu_memory_utilization=self.options.gpu_memory_utilization, max_model_len=self.options.max_model_len,
            enforce_eager=self.options.enforce_eager, enable_sleep_mode=True, logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION, disable_log_stats=False,  # load() reads the scheduler's stats
            **self._attention(), **self.options.engine_args,
        )

    async def _start(self, args: Any) -> Any:
        """vLLM's engine, made on the loop that will serve it (its sockets and output handler live there)."""
        # Its engine process is started by spawn: a fork of a process that has used CUDA (a trainer
        # on the GPU beside it) cannot use CUDA.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        return self.vllm.AsyncLLMEngine.from_engine_args(args, stat_loggers=[lambda config, index: _LoadRecorder(self)])

    def _attention(self) -> dict[str, Any]:
        """FCA is vLLM's CUSTOM backend, registered by our ``vllm.general_plugins`` entry point."""
        if not self.options.fca or "attention_config" in self.options.engine_args:
            return {}
        from arctic_fca.vllm.plugin import BASE_ENV

        os.environ[BASE_ENV] = self.options.fca_base  # read by the plugin in vLLM's processes
        return {"attention_config": {"backend": "CUSTOM"}}

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return self.loop.run(self.engine.collective_rpc(method, args=args))

    # ---- generation --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        return self.submit(prompts, params).wait()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> PendingVllmRollout:
        """The call's requests go into vLLM's running batch at its next step; returns at once."""
        if self.asleep:
            raise engine_asleep("sampler")
        model = self.engine.model_config  # refused here by name, not deep inside vLLM
        check_prompts(prompts, model.get_vocab_size(), params, model.max_model_len)
        call = VllmCall(prompts, params)
        call.future = self.loop.start(self._run(call))
        return PendingVllmRollout(call)

    async def _run(self, call: VllmCall) -> None:
        sampling = self._sampling(call)
        call.task = asyncio.current_task()
        self._live.add(call)
        reads = [asyncio.ensure_future(self._read(call, prompt, sampling)) for prompt in range(len(call.prompts))]
        try:
            await asyncio.gather(*reads)
        finally:  # a failed or cancelled call takes its other requests out of vLLM's batch
            for read in reads:
                read.cancel()
            self._live.discard(call)
        call.stamp(self.policy_version)

    def _sampling(self, call: VllmCall) -> Any:
        from vllm.sampling_params import RequestOutputKind

        params = call.params
        return self.vllm.SamplingParams(
            n=params.n // call.copies, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            min_p=params.min_p, repetition_penalty=params.repetition_penalty,
            max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids or None, seed=params.seed,
            ignore_eos=params.ignore_eos, logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA,  # tokens as drawn: each is stamped with its policy version
        )

    async def _read(self, call: VllmCall, prompt: int, sampling: Any) -> None:
        """One prompt's request; closing it (cancellation) makes vLLM abort it."""
        samples = call.samples[prompt]
        request = {"prompt_token_ids": list(call.prompts[prompt])}
        async for output in self.engine.generate(request, sampling, f"arctic-{next(self._request_ids)}"):
            for completion in output.outputs:
                sample = samples.setdefault(completion.index, SampleRecord())
                tokens = list(completion.token_ids)
                sample.tokens += tokens
                sample.logprobs += [step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)]

    def load(self) -> dict[str, int]:
        """Samples running and waiting and KV use, as vLLM's scheduler last reported them."""
        stats, blocks = self._scheduler, self.engine.vllm_config.cache_config.num_gpu_blocks or 0
        return {"running": stats.num_running_reqs if stats else 0, "waiting": stats.num_waiting_reqs if stats else 0,
                "requests": len(self._live), "preempted": self._preempted,
                "kv_used_blocks": round(stats.kv_cache_usage * blocks) if stats else 0, "kv_blocks": blocks}

    # ---- weights and lifecycle -----------------------------------------------------------------

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        named = [(name, tensor.detach()) for name, tensor in weights]
        if named and named[0][1].is_cuda:
            from arctic_core.weights.ipc import export_cuda_ipc

            payload, buffers = export_cuda_ipc(named, self.options.bucket_bytes, version)
            self.loop.run(self._swap_weights("import_weights_ipc", payload, version))
            del buffers  # every worker has copied (collective_rpc returns when they all have)
        else:
            tensors = {name: t.contiguous() for name, t in named}
            self.loop.run(self._swap_weights("arctic_load_tensors", tensors, version))

    async def _swap_weights(self, method: str, payload: Any, version: int) -> None:
        """New weights between two of vLLM's steps: every token drawn so far keeps the old version."""
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._outputs_delivered()
            for call in self._live:
                call.stamp(self.policy_version)
            await self.engine.collective_rpc(method, args=(payload,))
            # cached KV belongs to the old policy; requests in flight are recomputed under the new one
            await self.engine.reset_prefix_cache(reset_running_requests=True)
            self.policy_version = version
        finally:
            await self.engine.resume_generation()

    async def _outputs_delivered(self) -> None:
        """Wait until every token vLLM drew before its pause is in a call's records. In vLLM 0.24 they
        travel, in order and all on this loop, from its socket reader to an asyncio queue, from its
        output handler to each request's collector, and from there to ``_read``; the pause's answer
        came after them on the same socket. Nothing in transit for two rounds of the loop: delivered."""
        quiet = 0
        while quiet < 2:
            await asyncio.sleep(0)
            states = self.engine.output_processor.request_states.values()
            in_transit = not self.engine.engine_core.outputs_queue.empty() or any(
                s.queue is not None and s.queue.output is not None for s in states)
            quiet = 0 if in_transit else quiet + 1

    def fca_stats(self) -> dict[str, int]:
        """How FCA's batches and work builds went so far, summed over the workers (empty without
        FCA): see ``ArcticWorkerExtension.arctic_fca_stats``."""
        totals: Counter[str] = Counter()
        for stats in self._rpc("arctic_fca_stats") if self.options.fca else []:
            totals.update(stats)
        return dict(totals)

    def sleep(self) -> None:
        self.loop.run(self.engine.sleep(level=1))
        self.asleep = True

    def wake(self) -> None:
        self.loop.run(self.engine.wake_up())
        self.asleep = False

    def shutdown(self) -> None:
        """Calls in flight are cancelled (and aborted in vLLM) before vLLM stops."""
        if self.loop.closed:
            return
        self.loop.run(self._cancel_calls())
        self.engine.shutdown()
        self.loop.close()
        self.asleep = True

    async def _cancel_calls(self) -> None:
        tasks = [call.task for call in self._live]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class SampleRecord:
    """One sample as vLLM streams it, with the policy version of each token stamped so far."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def stamp(self, version: int) -> None:
        """The tokens not stamped yet were drawn by ``version``."""
        self.versions += [version] * (len(self.tokens) - len(self.versions))


class VllmCall:
    """One generate call: a vLLM request per prompt of ``n`` samples. vLLM refuses greedy decoding
    with n > 1, so the n greedy samples are one sample repeated (``copies``)."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self.prompts, self.params = prompts, params
        self.copies = params.n if params.greedy else 1
        self.samples: list[dict[int, SampleRecord]] = [{} for _ in prompts]  # by vLLM's sample index
        self.version = 0  # the policy version when the call ended
        self.future: Future[None] | None = None  # its task, seen from the caller's thread
        self.task: asyncio.Task | None = None

    def stamp(self, version: int) -> None:
        self.version = version
        for samples in self.samples:
            for sample in samples.values():
                sample.stamp(version)

    def batch(self) -> RolloutBatch:
        responses, index, logprobs, versions = [], [], [], []
        for prompt, samples in enumerate(self.samples):
            for _, sample in sorted(samples.items()) * self.copies:
                responses.append(sample.tokens)
                index.append(prompt)
                logprobs.append(sample.logprobs)
                versions.append(sample.versions)
        return RolloutBatch.from_samples(self.prompts, responses, index, logprobs, self.version, versions)


class PendingVllmRollout:
    """A call in vLLM's batch, answered as a :class:`RolloutBatch`."""

    def __init__(self, call: VllmCall) -> None:
        self.call = call

    def wait(self, timeout: float | None = None) -> RolloutBatch:
        try:
            self.call.future.result(timeout)
        except CancelledError:
            raise RequestCancelled("the generate call was cancelled") from None
        return self.call.batch()

    def cancel(self) -> None:
        self.call.future.cancel()


class _LoadRecorder:
    """vLLM's per-engine stat logger interface, keeping the scheduler's latest figures for ``load()``."""

    def __init__(self, sampler: VllmSampler) -> None:
        self.sampler = sampler

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
        if scheduler_stats is not None:
            self.sampler._scheduler = scheduler_stats
        if iteration_stats is not None:
            self.sampler._preempted += iteration_stats.num_preempted_reqs

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass
