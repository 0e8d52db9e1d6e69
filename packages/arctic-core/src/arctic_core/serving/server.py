"""The server: owns the engines and answers the protocol's operations.

It builds the trainer, sampler and (optionally) reference engines from the config by plugin name,
keeps the policy version, and runs calls side by side as ``call_gate`` allows: generate calls
together (a sampler with ``submit`` batches them at its next step; one without gets them one at a
time) and beside training, training calls one at a time, lifecycle calls alone. Several clients
can share one server; a ``fwd_bwd`` never interleaves with a ``step``.

Weight sync while generate calls are in flight: the sampler takes the new weights between two of
its steps, and samples in flight go on with them; each token carries the version that drew it
(``RolloutBatch.token_policy_version``, and per sample the oldest in ``policy_version``).

Generate calls in flight are bounded (``server.max_generate_calls``): past it a call is refused
with :class:`ServerBusy` at once, never queued without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import resource
import shutil
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from arctic_core.config import ArcticConfig
from arctic_core.staleness import drop_stale
from arctic_core.errors import ArcticError, RequestError, ServerBusy, engine_asleep
from arctic_core.hf import check_batch_fits, copy_tokenizer_files
from arctic_core.plugins.interfaces import (
    ConcurrentSampling,
    LogProbBackend,
    LossContext,
    SamplingBackend,
    TrainingBackend,
)
from arctic_core.losses.objective import build_objective, build_processors
from arctic_core.serving import checkpoint_folders
from arctic_core.serving.call_gate import CallGate
from arctic_core.serving.cancellation import Cancellation
from arctic_core.checkpoint_files import HF_EXPORT, STATE_FILE
from arctic_core.protocol import (
    CheckpointRequest,
    Empty,
    EnginesRequest,
    FwdBwdRequest,
    GenerateRequest,
    GenerateResult,
    LogProbsRequest,
    LogProbsResult,
    Message,
    OPS,
    Result,
    StatusResult,
    StepRequest,
    SyncWeightsResult,
)
from arctic_core.plugins.checks import check_plugins
from arctic_core.plugins.registry import Registry, default_registry

log = logging.getLogger(__name__)


class ArcticServer:
    """Engines behind the five calls (plus lifecycle); transports call :meth:`handle`."""

    def __init__(self, config: ArcticConfig, registry: Registry | None = None) -> None:
        # Local folders (Hub models fetched) before any engine spends seconds starting: engines load
        # only local folders.
        self.config = config = config.with_local_models()
        self.registry = registry or default_registry()
        self.policy_version = 0
        self.step_count = 0
        self.gradients_pending = False  # a fwd_bwd has accumulated gradients since the last step
        self.gate = CallGate(config.colocate)
        self._generate_calls = 0  # in flight, bounded by server.max_generate_calls
        self._counting = threading.Lock()
        self._sampling = threading.Lock()  # one generate at a time on a sampler without ``submit``
        self._colocating = threading.Lock()  # generate calls side by side wake the sampler once
        # Async callers' calls run here: a thread per call in flight (a generate call waits for its
        # samples in it), more than asyncio's default pool would give.
        self._threads = ThreadPoolExecutor(config.server.max_generate_calls + 16, thread_name_prefix="arctic-call")
        self._closed = False
        self.asleep: set[str] = set()  # engines put to sleep, by the client or by colocation
        # Every plugin and its options are checked before the first engine spends minutes loading.
        check_plugins(config, self.registry)
        self.trainer: TrainingBackend | None = None
        self.sampler: SamplingBackend | None = None
        self.reference: LogProbBackend | None = None
        try:
            self._build_engines()
        except BaseException:
            for engine in filter(None, self._engine_map().values()):  # free what was built
                try:
                    engine.shutdown()
                except Exception:
                    log.exception("shutting down %s after a failed start", type(engine).__name__)
            raise

    def _build_engines(self) -> None:
        config = self.config
        self.trainer = self._build("training_backend", config.trainer.backend, config.trainer, config.model)
        self.sampler = self._build("sampling_backend", config.sampler.backend, config.sampler, config.model)
        if config.reference is not None:
            ref_model = config.reference.model or config.model
            self.reference = self._build("logprob_backend", config.reference.backend, config.reference, ref_model)
        self.weight_transport = self.registry.get("weight_transport", config.weight_sync.transport)(config.weight_sync)

    def _build(self, kind: str, name: str, *args: Any) -> Any:
        factory = self.registry.get(kind, name)
        log.info("building %s %r", kind, name)
        return factory(*args, seed=self.config.seed)

    @property
    def closed(self) -> bool:
        """True once ``shutdown`` has run: every later call is refused."""
        return self._closed

    # ----------------------------------------------------------------- dispatch
    def handle(self, op: str, request: Message, cancel: Cancellation | None = None) -> Result:
        """Run one operation once ``call_gate`` lets it (see the module doc); ``cancel`` stops a
        generate call whose caller went away. Unknown ops and wrong request types are refused."""
        _check_request(op, request)
        with self._admitted(op):
            return self._run(op, request, cancel)

    async def ahandle(self, op: str, request: Message, cancel: Cancellation | None = None) -> Result:
        """:meth:`handle` for an event loop: the call runs in the server's threads; a cancelled
        awaiting task cancels a generate call."""
        _check_request(op, request)
        self._check_open()  # before its threads, which end with the server
        cancel = cancel or Cancellation()
        with self._admitted(op):
            call = asyncio.get_running_loop().run_in_executor(self._threads, self._run, op, request, cancel)
            try:
                return await call
            except asyncio.CancelledError:
                cancel.cancel()
                raise

    @contextlib.contextmanager
    def _admitted(self, op: str) -> Iterator[None]:
        """Counts the generate calls in flight; one past ``server.max_generate_calls`` is refused."""
        if op != "generate":
            yield
            return
        with self._counting:
            limit = self.config.server.max_generate_calls
            if self._generate_calls >= limit:
                raise ServerBusy(f"the server holds {limit} generate calls (server.max_generate_calls); "
                                 f"retry in {ServerBusy.retry_after:g} s")
            self._generate_calls += 1
        try:
            yield
        finally:
            with self._counting:
                self._generate_calls -= 1

    def _run(self, op: str, request: Message, cancel: Cancellation | None) -> Result:
        arrived = time.perf_counter()
        with self.gate.enter(op):
            self._check_open()
            start = time.perf_counter()
            if self.config.colocate and op in _ENGINES_NEEDED:  # status wakes no engine: it never waits here
                with self._colocating:
                    self._colocate(op, request)
            try:
                result: Result = self._op_generate(request, cancel) if op == "generate" \
                    else getattr(self, f"_op_{op}")(request)
            except Exception as exc:
                # Close what the failed call left open, here, on the thread that opened it: torch's
                # checkpoint keeps its saved-tensor hooks in a suspended generator that the traceback
                # holds, and closed later on another thread it leaves this one's hooks in place,
                # breaking every later backward on it (the HTTP server runs calls on a pool).
                traceback.clear_frames(exc.__traceback__)
                raise
            result.metrics.update(call_metrics(result.metrics, time.perf_counter() - start))
            result.metrics["waited_seconds"] = start - arrived  # behind calls that may not run beside it
            return result

    def _check_open(self) -> None:
        if self._closed:
            raise RequestError("the server has been shut down")

    def load(self) -> dict[str, Any]:
        """Calls running and waiting, and the sampler's own load when it reports one (samples
        running and waiting, KV cache use): ``/health`` and ``/metrics``."""
        own = self.sampler.load() if callable(getattr(self.sampler, "load", None)) else {}
        return {"calls": self.gate.state(), "generate_calls": self._generate_calls, "sampler": own}

    # ----------------------------------------------------------------- operations
    def _op_generate(self, req: GenerateRequest, cancel: Cancellation | None = None) -> GenerateResult:
        if isinstance(self.sampler, ConcurrentSampling):
            pending = self.sampler.submit(req.prompts, req.params)
            if cancel is not None:
                cancel.on_cancel(pending.cancel)
            batch = pending.wait()
        else:
            with self._sampling:
                batch = self.sampler.generate(req.prompts, req.params)
        tokens = int(batch.response_lens.sum())
        return GenerateResult(batch=batch,
                              metrics={"responses": float(batch.num_responses), "generated_tokens": float(tokens)})

    def _op_log_probs(self, req: LogProbsRequest) -> LogProbsResult:
        engine: LogProbBackend = self.trainer
        if req.model == "reference":
            if self.reference is None:
                raise RequestError("no reference engine is configured; add a `reference:` section to the config")
            engine = self.reference
        processors = build_processors(self.registry, req.processors, req.temperature)
        outputs = engine.log_probs(req.batch, processors)
        return LogProbsResult(outputs=outputs, metrics={"tokens": float(req.batch.total_tokens())})

    def _op_fwd_bwd(self, req: FwdBwdRequest) -> Result:
        objective = build_objective(self.registry, req.loss, req.temperature)
        batch, staleness = req.batch, {}
        if req.max_staleness is not None:  # tokens of too old a policy leave the loss
            batch, staleness = drop_stale(req.batch, self.policy_version, req.max_staleness)
        ctx = LossContext.of(batch, req.max_response_len)
        # Bad input is refused here, before any gradient is touched: once the trainer computes,
        # any failure (a loss term refusing a later micro-batch, one rank of several) may have
        # added part of the gradient, and every gradient since the last step is dropped.
        objective.check(batch, ctx)
        if "trainer" in self.asleep:
            raise engine_asleep("trainer")
        check_batch_fits(batch, self.model_config)
        with self._gradients_dropped_on_failure(refusals_change_nothing=False):
            metrics = backend_metrics(self.trainer, "forward_backward",
                                      self.trainer.forward_backward(batch, objective, ctx, req.scale))
        # A batch of responses whose tokens are all masked out still ran a backward (a zero gradient):
        # the next step() applies it as every framework's loop does (AdamW's momentum and weight decay
        # move the weights, the schedule advances). A batch of no response ran nothing.
        self.gradients_pending |= batch.num_responses > 0
        metrics["tokens"] = float(batch.total_tokens())
        metrics["packed_tokens"] = float(batch.packed_tokens())  # tokens / packed_tokens: the dedup ratio
        return Result(metrics={**metrics, **staleness})

    def _op_step(self, req: StepRequest) -> Result:
        if not self.gradients_pending:
            # Nothing to apply: a no-op, so the weights, optimizer state, LR schedule and step
            # count stay as they are (an engine stepped with no gradient can be left broken).
            return Result(metrics={"grad_norm": 0.0, "skipped": 1.0, "step": float(self.step_count)})
        with self._gradients_dropped_on_failure():
            metrics = backend_metrics(self.trainer, "optimizer_step", self.trainer.optimizer_step(lr=req.lr))
        self.gradients_pending = False
        # A backend skips a step whose gradients are not finite (and drops them): no step is counted.
        skipped = metrics.pop("skipped", 0.0)
        self.step_count += 0 if skipped else 1
        return Result(metrics={**metrics, "skipped": skipped, "step": float(self.step_count)})

    def _op_sync_weights(self, req: Empty) -> SyncWeightsResult:
        version = self.policy_version + 1  # counted once the samplers have it: a failed sync is retried as it
        metrics = backend_metrics(self.weight_transport, "sync",
                                  self.weight_transport.sync(self.trainer, [self.sampler], version))
        self.policy_version = version
        return SyncWeightsResult(policy_version=version, metrics=metrics)

    def _op_save_checkpoint(self, req: CheckpointRequest) -> StatusResult:
        target = checkpoint_folders.checkpoint_path(req.path)
        staging = checkpoint_folders.staging_for(target)  # refuses to replace anything but a checkpoint
        try:
            staging.mkdir(parents=True)
            self.trainer.save_checkpoint(staging / "trainer")
            if req.export_hf:
                self.trainer.export_hf(staging / HF_EXPORT)
                copy_tokenizer_files(self.config.model.path, staging / HF_EXPORT)
            (staging / STATE_FILE).write_text(json.dumps(self._state()))
            checkpoint_folders.publish(staging, target)  # readers never see a half-written checkpoint
        except OSError as exc:
            raise RequestError(f"cannot save a checkpoint at {target}: {exc}") from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if req.keep_last is not None:
            checkpoint_folders.prune(target, req.keep_last)
        return self._status()

    def _op_load_checkpoint(self, req: CheckpointRequest) -> StatusResult:
        path = checkpoint_folders.checkpoint_path(req.path)
        state = checkpoint_folders.read_checkpoint(path)  # checked before any engine is touched
        self.trainer.load_checkpoint(path / "trainer")  # all of it, or a RequestError and nothing changed
        self.gradients_pending = False  # the engines drop gradients accumulated before the load
        self.step_count = state.step
        # The sampler must serve the restored weights; the version moves forward so that
        # results from before the load are never mistaken for results of the restored policy.
        self.policy_version = max(self.policy_version, state.policy_version) + 1
        self.weight_transport.sync(self.trainer, [self.sampler], self.policy_version)
        return self._status()

    def _op_sleep(self, req: EnginesRequest) -> Result:
        for name in self._names(req.engines):
            self._set_awake(name, False)
        return Result()

    def _op_wake(self, req: EnginesRequest) -> Result:
        for name in self._names(req.engines):
            self._set_awake(name, True)
        return Result()

    def _op_status(self, req: Empty) -> StatusResult:
        # The load too: a client's only way to read it (an adapter's vLLM-style /metrics polls it),
        # and status never waits behind other calls. A key of ``info``, not a field, so that clients
        # older than it still read the result.
        status = self._status()
        status.info["load"] = self.load()
        return status

    def _op_shutdown(self, req: Empty) -> Result:
        for engine in self._engines(None):
            engine.shutdown()
        self._closed = True
        self._threads.shutdown(wait=False)
        return Result()

    # ----------------------------------------------------------------- helpers
    def _engines(self, names: list[str] | None) -> list[Any]:
        return [self._engine_map()[n] for n in self._names(names)]

    def _engine_map(self) -> dict[str, Any]:
        return {"trainer": self.trainer, "sampler": self.sampler, "reference": self.reference}

    def _names(self, names: list[str] | None) -> list[str]:
        engines = self._engine_map()
        chosen = names if names is not None else [n for n, e in engines.items() if e is not None]
        missing = [n for n in chosen if engines.get(n) is None]
        if missing:
            raise RequestError(f"engine(s) {missing} not configured on this server")
        return chosen

    def _set_awake(self, name: str, awake: bool) -> None:
        """Sleep or wake one engine; idempotent (a second sleep or a wake of an awake engine is a no-op)."""
        if awake == (name not in self.asleep):
            return
        engine = self._engine_map()[name]
        if awake:
            engine.wake()
            self.asleep.discard(name)
        else:
            engine.sleep()
            self.asleep.add(name)

    def _colocate(self, op: str, request: Message) -> None:
        """Wake what ``op`` needs; put the other engines to sleep first, so that their memory is
        free before the needed ones take theirs. Lifecycle calls are left alone."""
        needed = _ENGINES_NEEDED.get(op)
        if needed is None:
            return
        if op == "log_probs":
            needed = {"reference" if request.model == "reference" else "trainer"}
        configured = set(self._names(None))
        for name in sorted(configured - needed - self.asleep):
            self._set_awake(name, False)
        for name in sorted(needed & configured & self.asleep):
            self._set_awake(name, True)

    @functools.cached_property
    def model_config(self) -> PretrainedConfig:
        """The trainer's model's config (its vocabulary and positions, which a batch must fit)."""
        return AutoConfig.from_pretrained(self.config.model.path)

    @contextlib.contextmanager
    def _gradients_dropped_on_failure(self, refusals_change_nothing: bool = True) -> Iterator[None]:
        """Every gradient accumulated since the last step is dropped when the call inside fails: a
        fwd_bwd may have added part of its own (the sum would be silently wrong), a step may have
        clipped them in place or applied part of them (never apply them twice). With
        ``refusals_change_nothing`` a refusal (an Arctic error: e.g. a trainer partly restored by a
        failed load) is taken to have changed nothing; a dead worker needs load_checkpoint."""
        passed_on = ArcticError if refusals_change_nothing else ()  # (): an except clause that catches nothing
        try:
            yield
        except passed_on:
            raise
        except Exception:
            self.gradients_pending = False
            try:
                self.trainer.discard_gradients()
            except Exception:  # the engine may be what failed (e.g. a dead worker); its restart clears it
                log.exception("discarding gradients after a failed call failed too")
            raise

    def _state(self) -> dict[str, int]:
        return {"policy_version": self.policy_version, "step": self.step_count}

    def _status(self) -> StatusResult:
        return StatusResult(policy_version=self.policy_version, step=self.step_count,
                            info={"config": self.config.model_dump()})


def _check_request(op: str, request: Message) -> None:
    if op not in OPS:
        raise RequestError(f"unknown operation {op!r}; operations: {sorted(OPS)}")
    expected = OPS[op][0]
    if not isinstance(request, expected):
        raise RequestError(f"operation {op!r} takes a {expected.__name__}, got {type(request).__name__}")


def backend_metrics(product: object, method: str, metrics: object) -> dict[str, float]:
    """What a backend or transport ``method`` returned, if it keeps the protocol: a dict of metrics
    (the server would otherwise fail on it later, naming nothing)."""
    if not (isinstance(metrics, dict) and all(isinstance(k, str) for k in metrics)):
        raise TypeError(f"{type(product).__name__}.{method} returned {type(metrics).__name__}: it returns a dict "
                        "of metrics, {name: number}")
    return metrics


# The engines each operation computes with (log_probs: the one its request names).
_ENGINES_NEEDED: dict[str, set[str]] = {
    "generate": {"sampler"}, "log_probs": set(), "fwd_bwd": {"trainer"}, "step": {"trainer"},
    "sync_weights": {"trainer", "sampler"}, "save_checkpoint": {"trainer"}, "load_checkpoint": {"trainer", "sampler"},
}


def call_metrics(metrics: dict[str, float], seconds: float) -> dict[str, float]:
    """Time, throughput and memory added to every result (the process's peak RSS; CUDA peak too)."""
    out = {"seconds": seconds, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    tokens = metrics.get("generated_tokens", metrics.get("tokens"))
    if tokens is not None and seconds > 0:
        out["tokens_per_s"] = tokens / seconds
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out
