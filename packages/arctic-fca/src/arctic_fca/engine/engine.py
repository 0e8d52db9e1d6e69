"""The embedded sampling engine: continuous batching over a paged KV cache with prefix sharing.

One loop, one step at a time, over four parts that each live in a module of their own:
- the **scheduler** admits waiting prompt groups while their blocks fit, lends running samples
  blocks as they grow (preempting the newest, to be recomputed, when the cache runs out), and picks
  the prompt tokens of each prefill step (``max_prefill_tokens`` at most, long prompts in chunks);
- the **model runner** prefills those tokens in one packed pass (each prompt ONCE, whatever ``n``,
  skipping full blocks another prompt already holds) with one decode row for every running sequence
  in front (a mixed step: running samples keep going while new prompts prefill), else decodes every
  running sequence one token, attention through FCA or plain paged decode as the cost model prices
  the step;
- the **step planner** prepares each decode step on the host (tables, slots, FCA plan, work items);
- **sampling** (``sampling.py``) draws the tokens on the device.
Decode steps run back to back: step t+1 is planned and queued, its input tokens taken from step t's
samples on the device, before the host reads step t's tokens, so the device never waits for the
host (prefill passes of whole prompts too: pass k+1 is queued before pass k's samples are read).
The host learns of a stop token one step late; that step's token of the finished sequence is
dropped. Finished sequences (stop token or ``max_tokens``) give their blocks back for the next
groups.

The loop runs in a thread of its own and serves every caller at once: a request submitted from
any thread (``submit``, or ``generate`` which waits for it) joins the running batch at the next
step, each request with its own settings and seed (``requests.py``). A weight update, sleep or
wake takes the engine between two steps; samples in flight go on with the new weights, each token
stamped with the policy version that drew it. A cancelled request leaves at the next step and
gives its blocks back.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from arctic_core.config import SamplingParams, StrictModel
from arctic_core.errors import RequestError, engine_asleep
from arctic_core.hf import check_prompts, stop_tokens
from arctic_core.host_copy import HostCopy
from arctic_fca.engine.blocks import BlockPool
from arctic_fca.engine.kv_cache import PagedKVCache
from arctic_fca.engine.model_runner import ModelRunner
from arctic_fca.engine.requests import GenerationRequest, RequestCancelled, token_seed
from arctic_fca.engine.sampling import RowParams, sample, seen_tokens
from arctic_fca.engine.scheduler import Admission, Scheduler
from arctic_fca.engine.sequence import GenerationOutput, PromptGroup, Sequence
from arctic_fca.engine.step_planner import StepPlanner
from arctic_fca.fca.layout import check_block_size
from arctic_fca.fca.tuning import DEFAULT_TUNING, Tuning

log = logging.getLogger(__name__)
IDLE_EXIT_S = 2.0  # the loop's thread ends after this long without work
_ENGINES: weakref.WeakSet[EmbeddedEngine] = weakref.WeakSet()


@atexit.register
def _stop_loops() -> None:
    """Every engine's loop stopped before the interpreter shuts down: a loop thread still alive
    then can abort the process (exit status 134)."""
    for engine in list(_ENGINES):
        engine.close()


class EngineOptions(StrictModel):
    block_size: int = Field(16, description="Tokens per KV block (a power of two >= 16).")
    kv_cache_tokens: int | None = Field(None, gt=0, description="KV cache size; default: 65536 on the CPU, "
                                        "gpu_memory_utilization of the device on CUDA.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=0.98, description="Share of the GPU the engine may fill "
                                          "(weights, activations, KV cache) when kv_cache_tokens is unset.")
    max_num_seqs: int = Field(256, gt=0, description="Sequences decoded together at most.")
    admission: Admission = Field("on_demand", description="on_demand: a prompt group runs once its prompt fits, "
                                 "samples take KV blocks as they grow, and when the cache runs out the newest are "
                                 "preempted and later recomputed (as in vLLM); worst_case: a group runs only once its "
                                 "samples' whole max_tokens fit (never preempted; fewer samples at once when they stop "
                                 "early).")
    max_prefill_tokens: int = Field(16384, gt=0, description="Prompt tokens per prefill step (a longer prompt "
                                    "runs alone unless chunked_prefill).")
    chunked_prefill: bool = Field(False, description="Split prompts longer than max_prefill_tokens across steps and "
                                  "give every running sequence one token in each prefill step (off: whole prompts, "
                                  "decode waits while they prefill).")
    fca: Literal["auto", "fca", "plain"] = Field("auto", description="auto: the cost model picks per step.")
    kernel: Literal["auto", "triton", "torch"] = Field("auto", description="Decode attention and sampling kernels: "
                                                       "auto is Triton on CUDA, the exact torch path elsewhere.")
    progress: bool | None = Field(None, description="Progress bar; None: only on a terminal.")
    cuda_graphs: bool = Field(True, description="Replay decode steps as CUDA graphs (CUDA only).")
    overlap_steps: bool = Field(True, description="Queue each decode step, and each prefill pass of whole prompts, "
                                "before the host reads the previous one's tokens (off: one at a time; the same "
                                "tokens when greedy or without stop tokens).")
    fused_decoder: bool = Field(True, description="Run Qwen3, Qwen2, Llama and Mistral models on the engine's own "
                                "decoder (fused kernels, same math); False: transformers' modules.")
    max_model_len: int | None = Field(None, gt=0, description="Prompt + new tokens at most; default: the model's "
                                      "max_position_embeddings.")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, block_size: int) -> int:
        check_block_size(block_size)
        return block_size

    @model_validator(mode="after")
    def _a_block_at_least(self) -> EngineOptions:
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} holds no block of {self.block_size} tokens")
        return self


@dataclass
class EngineStats:
    prefill_steps: int = 0
    mixed_steps: int = 0  # prefill steps that also decoded the running sequences
    prefill_tokens: int = 0  # prompt tokens run through the model
    prefix_hit_tokens: int = 0  # prompt tokens found in the cache instead
    decode_steps: int = 0
    fca_steps: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0  # wall clock, mixed steps included (each ends in a host read of its tokens)
    decode_seconds: float = 0.0
    decode_prepare_seconds: float = 0.0  # host side of decode steps: tables, FCA plan, work items
    calls_in_waves: int = 0  # generate calls whose groups could not all run at once
    preempted: int = 0  # samples that gave their blocks back to be recomputed
    most_running: int = 0  # samples decoded together at most


class EmbeddedEngine:
    """The engine's loop runs in a thread of its own: ``submit`` (or ``generate``) from any thread
    puts a request's prompts in line, and they join the running batch at the next step."""

    def __init__(self, model: PreTrainedModel, options: EngineOptions | None = None, *, seed: int = 0,
                 tuning: Tuning = DEFAULT_TUNING) -> None:
        self.options = options or EngineOptions()
        self.runner = ModelRunner(model, self.options, tuning)
        self.scheduler = Scheduler(self.runner.cache, self.options.block_size, self.options.max_num_seqs,
                                   self.options.max_prefill_tokens, self.options.admission)
        graphs = self.runner.graphs
        self.planner = StepPlanner(self.options.block_size, self.options.fca, self.runner.heads, self.runner.device,
                                   tuning, bucket=graphs.bucket if graphs else None, with_work=graphs is not None)
        self.seed = seed
        self.calls = 0
        self.policy_version = 0
        self.stats = EngineStats()
        # Work in flight, touched only by the loop's thread (under ``_step_lock``).
        self._waiting: deque[PromptGroup] = deque()  # not admitted yet (preempted samples first in line)
        self._prefilling: deque[PromptGroup] = deque()  # admitted, prompt not yet computed to its end
        self._running: list[Sequence] = []
        self._queued: QueuedPrefill | None = None  # a prefill pass whose samples the host has not read yet
        # Between threads: new requests, and calls that need the engine between two steps.
        self._signal = threading.Condition()
        self._inbox: deque[GenerationRequest] = deque()
        self._live: set[GenerationRequest] = set()  # submitted, not finished (changed under ``_signal``)
        self._load = {"running": 0, "waiting": 0}  # samples, as the loop left them after its last round
        self._pausing = 0  # threads waiting for the step lock (a weight update, sleep, wake)
        self._cancelling = False
        self._closed = False
        self._step_lock = threading.Lock()  # held by the loop while it runs steps
        self._loop: threading.Thread | None = None
        _ENGINES.add(self)

    @property
    def model(self) -> PreTrainedModel:
        return self.runner.model

    @property
    def cache(self) -> PagedKVCache:
        return self.runner.cache

    @property
    def pool(self) -> BlockPool:
        return self.scheduler.pool

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    # ---- lifecycle ---------------------------------------------------------------------------

    def update_weights(self, weights, version: int) -> None:
        """New weights between two steps. Samples in flight go on with them: each token carries
        the version that drew it; their K/V so far stay (computed by the old weights)."""
        with self._between_steps():
            self.scheduler.new_weights()  # cached prefixes hold K/V of the old weights (first: a load may fail halfway)
            self.runner.load_weights(weights)
            self.policy_version = version

    def sleep(self) -> None:
        """Free the KV cache and move the weights to the host (device memory for the trainer).
        Requests in flight fail: the engine cannot go on without its cache."""
        with self._between_steps():
            self._fail_all(engine_asleep("sampler"))
            self.runner.sleep()
            self.pool.clear_index()
            self.planner.reset()

    def wake(self) -> None:
        with self._between_steps():
            self.runner.wake()

    def close(self) -> None:
        """Stop the loop's thread; requests in flight fail."""
        with self._signal:
            self._closed = True
            self._signal.notify_all()
            loop = self._loop
        if loop is not None:
            loop.join()
        with self._step_lock:
            self._fail_all(RequestError("the sampling engine was shut down"))

    @property
    def asleep(self) -> bool:
        return not self.cache.allocated

    def load(self) -> dict[str, int]:
        """What runs now: samples decoding, samples waiting to start (in line or being prefilled),
        requests not finished, KV blocks held and the cache's blocks; and, counted since the start,
        samples preempted and decode steps run. The decode steps beside the server's count of generate
        calls show from outside the process (``/metrics``) whether calls share steps: calls run one at
        a time need each its own longest response's steps, calls batched together need them once."""
        with self._signal:  # the loop's own lists change under its feet: its last round's counts
            arriving = sum(len(r.prompts) * r.params.n for r in self._inbox)
            requests = len(self._live)
        return {"running": self._load["running"], "waiting": self._load["waiting"] + arriving,
                "requests": requests, "preempted": self.stats.preempted, "decode_steps": self.stats.decode_steps,
                "kv_used_blocks": self.scheduler.used_blocks, "kv_blocks": self.pool.capacity}

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the engine between two of its steps: the loop gives way at its next step."""
        with self._signal:
            self._pausing += 1
        try:
            with self._step_lock:
                yield
        finally:
            with self._signal:
                self._pausing -= 1
                self._signal.notify_all()

    # ---- requests ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """``n`` samples per prompt, in prompt-major order (prompt 0's samples first); blocks until done."""
        bar = tqdm(total=len(prompts) * params.n, unit="sample", desc="generate", leave=False,
                   disable=not (self.options.progress if self.options.progress is not None else sys.stderr.isatty()))
        try:
            request = self.submit(prompts, params, on_sample=lambda: bar.update(1))
            try:
                return request.wait()
            except BaseException:
                self.cancel(request)  # an interrupted caller leaves no work behind
                raise
        finally:
            bar.close()

    def submit(self, prompts: list[list[int]], params: SamplingParams,
               on_sample: Callable[[], None] | None = None) -> GenerationRequest:
        """Put a request in line (checked first: a request that could never run is refused here);
        ``wait()`` on the answer for its outputs."""
        if self.asleep:
            raise engine_asleep("sampler")
        check_prompts(prompts, self.model.config.vocab_size, params, self.max_model_len)
        self.scheduler.check(prompts, params)
        self._warn_of_waves(prompts, params)
        with self._signal:
            if self._closed:
                raise RequestError("the sampling engine was shut down")
            seed = params.seed if params.seed is not None else self.seed + self.calls
            self.calls += 1
            request = GenerationRequest([list(p) for p in prompts], params, seed, stop_tokens(self.model, params),
                                        on_sample)
            self._inbox.append(request)
            self._live.add(request)
            if self._loop is None:  # none yet, or it ended when idle
                self._loop = threading.Thread(target=self._serve, name="arctic-engine", daemon=True)
                self._loop.start()
            self._signal.notify_all()
        return request

    def cancel(self, request: GenerationRequest) -> None:
        """Stop a request: its samples leave the batch at the next step and give their blocks back."""
        with self._signal:
            if request.done:
                return
            request.cancelled = True
            self._cancelling = True
            self._signal.notify_all()

    def _warn_of_waves(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Say (once per engine, then in ``stats``) when a call's groups must run in waves: each wave
        decodes to its end, so such a rollout takes about as many times the steps, which a colocated
        trainer's memory share can silently cause."""
        why = self.scheduler.shortfall(prompts, params)
        if why is None:
            return
        if not self.stats.calls_in_waves:
            log.warning("the %d prompt groups of this call cannot all run at once: %s; they run in waves, "
                        "each decoding to its end", len(prompts), why)
        self.stats.calls_in_waves += 1

    # ---- the loop ----------------------------------------------------------------------------

    def _serve(self) -> None:
        """The loop's thread: while there is work, take new requests in and run a round of steps.
        Idle for ``IDLE_EXIT_S``, the thread ends (the next request starts another): an engine no
        one holds any more is then freed with its cache."""
        while True:
            with self._signal:
                # A thread waiting to hold the engine between steps goes first.
                while self._pausing or not (self._inbox or self._cancelling or self._has_work() or self._closed):
                    if not self._signal.wait(IDLE_EXIT_S) and not (self._inbox or self._has_work()):
                        self._loop = None
                        return
                if self._closed:
                    self._loop = None
                    return
                new, self._inbox = list(self._inbox), deque()
                cancelling, self._cancelling = self._cancelling, False
            with self._step_lock, torch.no_grad():
                self._line_up(new)
                if cancelling:
                    self._drop_cancelled()
                if self._has_work():
                    try:
                        if self.asleep:
                            raise engine_asleep("sampler")
                        self._round()
                    except BaseException as exc:  # every request in flight learns why
                        log.debug("generation failed", exc_info=True)
                        self._fail_all(exc)
                self._count_load()

    def _count_load(self) -> None:
        """The samples running and waiting, for ``load`` (read from other threads)."""
        waiting = sum(g.samples for g in self._waiting) + sum(g.samples for g in self._prefilling)
        self._load = {"running": len(self._running), "waiting": waiting}

    def _line_up(self, requests: list[GenerationRequest]) -> None:
        """New requests' prompts in line; one that a waiting group already asks for with the same
        settings joins that group (its prompt computed once for all), within ``max_num_seqs``."""
        waiting = {(tuple(g.prompt), g.request.settings): g for g in self._waiting if g.resumes is None}
        for request in requests:
            for index, prompt in enumerate(request.prompts):
                group = waiting.get((tuple(prompt), request.settings))
                if group is not None and group.samples + request.params.n <= self.scheduler.max_num_seqs:
                    group.join(request, index)
                    continue
                group = PromptGroup(index, prompt, request.params.n, request)
                self._waiting.append(group)
                waiting[(tuple(prompt), request.settings)] = group

    def _has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running or self._queued)

    def _interrupted(self) -> bool:
        """Whether the loop should leave its run of decode steps: a new request to admit, one to
        cancel, a thread waiting to hold the engine, or the engine closing."""
        return bool(self._inbox or self._cancelling or self._pausing or self._closed)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        seq.request.finish(seq)
        if seq.request.done:
            with self._signal:
                self._live.discard(seq.request)

    def _fail_all(self, error: BaseException) -> None:
        """Nothing survives a failed step: every block goes back, every request in flight fails, and
        the engine serves the next ones."""
        with self._signal:
            failed = [r for r in self._live if r not in self._inbox]
            self._live.difference_update(failed)
        for request in failed:
            request.fail(error)
        self._waiting, self._prefilling, self._running, self._queued = deque(), deque(), [], None
        self._count_load()
        self.scheduler.reset()
        self.planner.reset()

    def _drop_cancelled(self) -> None:
        """Cancelled requests leave: their waiting groups, and their running samples (blocks back).
        A group being prefilled finishes its pass first (its blocks are in the prefix index)."""
        for group in self._waiting:
            kept = [m for m in group.members if not m[0].cancelled]
            if kept and len(kept) < len(group.members):
                group.keep(kept)
        self._waiting = deque(g for g in self._waiting if not g.request.cancelled)
        for seq in [s for s in self._running if s.request.cancelled]:
            self.scheduler.finish(seq)
        self._running = [s for s in self._running if not s.request.cancelled]
        admitted = list(self._prefilling) + (self._queued.completed if self._queued else [])
        busy = {m[0] for g in admitted for m in g.members}
        with self._signal:
            gone = [r for r in self._live if r.cancelled and r not in busy]
            self._live.difference_update(gone)
            self._cancelling = any(r.cancelled for r in self._live)
        for request in gone:
            request.fail(RequestCancelled("the request was cancelled"))

    def _round(self) -> None:
        """Admit what fits, then one prefill pass or a run of decode steps."""
        queued = self._queued
        forking = sum(g.samples for g in queued.completed) if queued else 0
        admitted = self.scheduler.admit(self._waiting, len(self._running) + forking
                                        + sum(g.samples for g in self._prefilling))
        self._prefilling += admitted
        self.stats.prefix_hit_tokens += sum(g.cached for g in admitted)
        begin = time.perf_counter()
        if self._running and (self.options.chunked_prefill or not (self._prefilling or queued)):
            self._running = self._make_room(self._running)  # the step about to run decodes them
        if self._prefilling or queued:
            # Whole prompts: pass k+1 is queued before the host reads pass k's samples, so the
            # device goes from one pass to the next while the host forks them. Chunked passes
            # are read at once: the next one gives their samples a token.
            self._queued = self._queue_prefill(self._prefilling, self._running) if self._prefilling else None
            if queued is not None:
                self._running += self._take_samples(queued)
            ahead = self._prefilling and self.options.overlap_steps and not self.options.chunked_prefill
            if self._queued is not None and not ahead:
                self._running += self._take_samples(self._queued)
                self._queued = None
            self.stats.prefill_seconds += time.perf_counter() - begin
        elif self._running:
            # Through samples that finish, unless a waiting group could take the place they free.
            self._running = self._decode(self._running, go_on=lambda count: not self._waiting
                                         or count + self._waiting[0].samples > self.scheduler.max_num_seqs)
            self.stats.decode_seconds += time.perf_counter() - begin
        for seq in [s for s in self._running if s.done]:
            self._finish(seq)
        self._running = [s for s in self._running if not s.done]

    def _make_room(self, running: list[Sequence]) -> list[Sequence]:
        """The running sequences that keep going, with blocks for their next step: when they cannot
        all have blocks for a block's worth of steps, the newest are preempted and wait first in
        line to be recomputed (said once per engine in the log, then counted in ``stats``)."""
        kept, resumed = self.scheduler.preempt(running, self.options.block_size)
        if resumed:
            if not self.stats.preempted:
                log.warning("the KV cache ran out of blocks: %d running samples were preempted, to be recomputed "
                            "when blocks free up (raise gpu_memory_utilization or kv_cache_tokens)", len(resumed))
            self.stats.preempted += len(resumed)
            self.stats.generated_tokens -= len(resumed)  # each one's last token is drawn again
            self._waiting.extendleft(reversed(resumed))
        self.scheduler.grow(kept, 1)  # cannot fail: preempt left them room for a block's worth of steps
        return kept

    def _queue_prefill(self, prefilling: deque[PromptGroup], running: list[Sequence]) -> QueuedPrefill:
        """One prefill step (with a token for every running sequence when chunked) and its sampling,
        queued on the device."""
        chunked = self.options.chunked_prefill
        pieces = self.scheduler.next_prefill(prefilling, split=chunked)
        decoding = running if chunked else []
        step = self.planner.plan(decoding) if decoding else None
        logits = self.runner.prefill(pieces, step, np.array([s.tokens[-1] for s in decoding]))
        self.stats.prefill_steps += 1
        self.stats.mixed_steps += bool(decoding)
        self.stats.prefill_tokens += sum(p.end - p.start for p in pieces)
        completed = [p.group for p in pieces if p.completes]
        if not (decoding or completed):  # a chunk inside a prompt: nothing to sample yet
            return QueuedPrefill(decoding, completed, None)
        samples = np.repeat(np.arange(len(completed)), [g.samples for g in completed])  # each prompt's row per sample
        logits = torch.cat((logits[: len(decoding)], logits[len(decoding):][self.runner.on_device(samples)]))
        rows = [Row.of(s) for s in decoding] + [Row.first(g, j) for g in completed for j in range(g.samples)]
        tokens, logprobs = sample(logits, row_settings(rows, logits.shape[-1], self.runner.device),
                                  triton=self.runner.triton)
        return QueuedPrefill(decoding, completed, TokensInFlight(tokens, logprobs, self.policy_version))

    def _take_samples(self, queued: QueuedPrefill) -> list[Sequence]:
        """A queued prefill step's tokens read: appended to the sequences it decoded, and each prompt it
        completed forked into its samples (returned)."""
        if queued.samples is None:
            return []
        tokens, logprobs = queued.samples.read()
        tokens = [int(t) for t in tokens]
        decoding = queued.decoding
        self._append(decoding, tokens[: len(decoding)], logprobs[: len(decoding)], queued.samples.version)
        sequences, first = [], len(decoding)
        for group in queued.completed:
            picked = slice(first, first + group.samples)
            sequences += self.scheduler.fork(group, tokens[picked], logprobs[picked], queued.samples.version)
            first += group.samples
        self.stats.generated_tokens += len(sequences)
        return sequences

    def _decode(self, running: list[Sequence], go_on: Callable[[int], bool]) -> list[Sequence]:
        """Decode steps back to back; the sequences still running when they stop (each one that
        finished is finished here). Each step is planned while the device runs the one before;
        its input tokens stay on the device (with ``overlap_steps`` off the host reads each step's
        tokens before queueing the next). A sequence that finishes leaves the batch of the next step
        while ``go_on(sequences left)``, else ends the run (the caller admits waiting prompts): the
        device goes on without waiting for the host to plan a new batch from scratch (in RL
        rollouts, where samples end at every length, that was a gap in most steps). A new request,
        a cancelled one or a weight update ends the run too. A step queued before the host read the
        finish still computes the finished row; its token is dropped."""
        overlap = self.options.overlap_steps
        batch, in_flight, row_params, leaving = running, deque(), None, []
        self.stats.most_running = max(self.stats.most_running, len(batch))
        ids: np.ndarray | torch.Tensor = np.array([s.tokens[-1] for s in batch])
        step = self.planner.plan(batch)
        while True:
            logits = self.runner.decode(ids, step)
            if row_params is None:  # fixed for the batch; a smaller batch takes its rows
                row_params = row_settings([Row.of(s) for s in batch], logits.shape[-1], self.runner.device)
            tokens, logprobs = sample(logits[: len(batch)], row_params, triton=self.runner.triton)
            if row_params.seen is not None:  # the repetition penalty's tokens so far, kept current on the device
                row_params.seen.scatter_(1, tokens[:, None], True)
            row_params = row_params.next_token()
            in_flight.append((batch, TokensInFlight(tokens, logprobs, self.policy_version)))
            self.stats.decode_steps += 1
            self.stats.fca_steps += step.plan is not None
            # The next step for the same batch, unless one reaches its length limit, or the cache
            # cannot lend the next step's blocks (the caller then preempts).
            planned = (all(len(s.tokens) + len(in_flight) < s.max_len for s in batch)
                       and self.scheduler.grow(batch, len(in_flight) + 1))
            if planned:
                step = self.planner.plan(batch, ahead=len(in_flight))
            # Read the older step while the newer one runs.
            ended = False
            while len(in_flight) > (1 if overlap else 0):
                ended |= self._read(in_flight.popleft())
            for seq in leaving:  # left the batch before the step just read, which gave their last token
                self._finish(seq)
            leaving = []
            interrupted = self._interrupted()
            if planned and not ended and not interrupted:
                ids = tokens if overlap else np.array([s.tokens[-1] for s in batch])
                continue
            going_on = [not s.done and len(s.tokens) + len(in_flight) < s.max_len for s in batch]
            stay = [row for row, on in enumerate(going_on) if on]
            smaller = [batch[row] for row in stay]
            if interrupted or not (smaller and go_on(len(smaller))
                                   and self.scheduler.grow(smaller, len(in_flight) + 1)):
                break  # the steps still queued are read below
            leaving = [s for s, on in zip(batch, going_on, strict=True) if not on]
            step = self.planner.plan(smaller, ahead=len(in_flight))
            rows = self.runner.on_device(np.array(stay))
            ids = tokens[rows] if in_flight else np.array([s.tokens[-1] for s in smaller])
            row_params, batch = row_params.rows(rows), smaller
        while in_flight:
            self._read(in_flight.popleft())
        for seq in leaving + [s for s in batch if s.done]:
            self._finish(seq)
        self.stats.decode_prepare_seconds = self.planner.prepare_seconds
        return [s for s in batch if not s.done]

    def _read(self, step: tuple[list[Sequence], TokensInFlight]) -> bool:
        """A queued step's tokens onto the sequences it ran; whether any sequence finished."""
        batch, samples = step
        return self._append(batch, *samples.read(), samples.version)

    def _append(self, running: list[Sequence], tokens: list[float], logprobs: list[float], version: int) -> bool:
        """One step's tokens onto the unfinished sequences; whether any sequence finished."""
        finished = False
        for seq, token, logprob in zip(running, tokens, logprobs, strict=True):
            if seq.done:
                continue
            seq.append(int(token), logprob, version)
            self.stats.generated_tokens += 1
            finished |= seq.done
        return finished


@dataclass
class QueuedPrefill:
    """A prefill step queued on the device: the running sequences it gives a token (chunked
    prefill), the prompts it completes, and its samples (None: a chunk inside a prompt)."""

    decoding: list[Sequence]
    completed: list[PromptGroup]
    samples: TokensInFlight | None


class TokensInFlight:
    """A step's sampled tokens and log-probs on their way to the host: the copy is queued behind the
    step, and ``read`` waits for it alone (not for the steps queued after it). ``version``: the
    policy that drew them."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor, version: int) -> None:
        self.copy = HostCopy(torch.stack((tokens.to(logprobs.dtype), logprobs)))  # token ids are exact in fp32
        self.version = version

    def read(self) -> tuple[list[float], list[float]]:
        tokens, logprobs = self.copy.tolist()
        return tokens, logprobs


@dataclass(frozen=True)
class Row:
    """One row of a sampling step: its request's settings, its tokens so far (the repetition
    penalty reads them) and the seed of the token it draws."""

    params: SamplingParams
    tokens: list[int]
    seed: int

    @classmethod
    def of(cls, seq: Sequence) -> Row:
        """A running sample's next token."""
        return cls(seq.request.params, seq.tokens, token_seed(seq.key, len(seq.tokens)))

    @classmethod
    def first(cls, group: PromptGroup, sample: int) -> Row:
        """The first token of sample ``sample`` of a prompt (a preempted sample: its next one)."""
        request = group.owner(sample)[0]
        return cls(request.params, group.prompt, token_seed(group.sample_key(sample), len(group.prompt)))


def row_settings(rows: list[Row], vocab: int, device: torch.device) -> RowParams:
    """Per-row settings (each row's request's), on the device. Min-p and the repetition penalty are
    one number for all rows when the rows agree (the kernels' fast path), else one per row."""
    params = [r.params for r in rows]

    def column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, device=device, dtype=dtype)

    def shared_or_column(values: list[float]) -> float | torch.Tensor:
        return values[0] if len(set(values)) == 1 else column(values)

    min_p = [0.0 if p.greedy else p.min_p for p in params]
    penalty = [p.repetition_penalty for p in params]
    penalised = any(x != 1.0 for x in penalty)
    return RowParams(temperature=column([p.temperature for p in params]),
                     top_k=column([p.top_k for p in params], torch.long),
                     top_p=column([p.top_p for p in params]),
                     any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
                     any_top_p=any(p.top_p < 1 and not p.greedy for p in params),
                     min_p=shared_or_column(min_p), repetition_penalty=shared_or_column(penalty),
                     seen=seen_tokens([r.tokens for r in rows], vocab, device) if penalised else None,
                     seeds=column([r.seed for r in rows], torch.long))
