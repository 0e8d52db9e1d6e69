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
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from arctic_core.config import SamplingParams, StrictModel
from arctic_core.errors import engine_asleep
from arctic_core.hf import check_prompts, stop_tokens
from arctic_core.host_copy import HostCopy
from arctic_fca.engine.blocks import BlockPool
from arctic_fca.engine.kv_cache import PagedKVCache
from arctic_fca.engine.model_runner import ModelRunner
from arctic_fca.engine.sampling import RowParams, sample, seen_tokens
from arctic_fca.engine.scheduler import Admission, Scheduler
from arctic_fca.engine.sequence import GenerationOutput, PromptGroup, Sequence
from arctic_fca.engine.step_planner import StepPlanner
from arctic_fca.fca.layout import check_block_size
from arctic_fca.fca.tuning import DEFAULT_TUNING, Tuning

log = logging.getLogger(__name__)


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
        self.pool.clear_index()  # cached prefixes hold K/V of the old weights (first: a load may fail halfway)
        self.runner.load_weights(weights)
        self.policy_version = version

    def sleep(self) -> None:
        """Free the KV cache and move the weights to the host (device memory for the trainer)."""
        self.runner.sleep()
        self.pool.clear_index()
        self.planner.reset()

    def wake(self) -> None:
        self.runner.wake()

    @property
    def asleep(self) -> bool:
        return not self.cache.allocated

    # ---- generation --------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """``n`` samples per prompt, in prompt-major order (prompt 0's samples first)."""
        if self.asleep:
            raise engine_asleep("sampler")
        check_prompts(prompts, self.model.config.vocab_size, params, self.max_model_len)
        self.scheduler.check(prompts, params)
        self._warn_of_waves(prompts, params)
        stops = stop_tokens(self.model, params)
        seed = params.seed if params.seed is not None else self.seed + self.calls
        self.calls += 1
        generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        waiting = deque(PromptGroup(i, list(p), params.n) for i, p in enumerate(prompts))
        bar = tqdm(total=len(prompts) * params.n, unit="sample", desc="generate", leave=False,
                   disable=not (self.options.progress if self.options.progress is not None else sys.stderr.isatty()))
        try:
            finished = self._run(waiting, params, generator, stops, bar)
        except BaseException:
            # Nothing survives a failed call: every block goes back, and the engine serves the next call.
            self.scheduler.reset()
            self.planner.reset()
            raise
        finally:
            bar.close()
        return [GenerationOutput(i, s.tokens[len(p):], s.logprobs, self.policy_version)
                for i, p in enumerate(prompts) for s in sorted(finished[i], key=lambda s: s.order)]

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

    def _run(self, waiting: deque[PromptGroup], params: SamplingParams, generator: torch.Generator, stops: set[int],
             bar: tqdm) -> dict[int, list[Sequence]]:
        running: list[Sequence] = []
        prefilling: deque[PromptGroup] = deque()  # admitted, prompt not yet computed to its end
        queued: QueuedPrefill | None = None  # a prefill pass whose samples the host has not read yet
        finished: dict[int, list[Sequence]] = {}

        def finish(seq: Sequence) -> None:
            self.scheduler.finish(seq)
            finished.setdefault(seq.prompt_index, []).append(seq)
            bar.update(1)

        while waiting or running or prefilling or queued:
            forking = sum(g.samples for g in queued.completed) if queued else 0
            admitted = self.scheduler.admit(waiting, len(running) + sum(g.samples for g in prefilling) + forking,
                                            params)
            prefilling += admitted
            self.stats.prefix_hit_tokens += sum(g.cached for g in admitted)
            begin = time.perf_counter()
            if running and (self.options.chunked_prefill or not (prefilling or queued)):
                running = self._make_room(running, waiting)  # the step about to run decodes them
            if prefilling or queued:
                # Whole prompts: pass k+1 is queued before the host reads pass k's samples, so the
                # device goes from one pass to the next while the host forks them. Chunked passes
                # are read at once: the next one gives their samples a token.
                before = queued
                queued = self._queue_prefill(prefilling, running, params, generator) if prefilling else None
                if before is not None:
                    running += self._take_samples(before, params, stops)
                ahead = prefilling and self.options.overlap_steps and not self.options.chunked_prefill
                if queued is not None and not ahead:
                    running += self._take_samples(queued, params, stops)
                    queued = None
                self.stats.prefill_seconds += time.perf_counter() - begin
            elif running:
                # Through samples that finish, unless a waiting group could take the place they free.
                running = self._decode(running, params, generator, stops, finish, go_on=lambda count: not waiting
                                       or count + waiting[0].samples > self.scheduler.max_num_seqs)
                self.stats.decode_seconds += time.perf_counter() - begin
            for seq in [s for s in running if s.done]:
                finish(seq)
            running = [s for s in running if not s.done]
        return finished

    def _make_room(self, running: list[Sequence], waiting: deque[PromptGroup]) -> list[Sequence]:
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
            waiting.extendleft(reversed(resumed))
        self.scheduler.grow(kept, 1)  # cannot fail: preempt left them room for a block's worth of steps
        return kept

    def _queue_prefill(self, prefilling: deque[PromptGroup], running: list[Sequence], params: SamplingParams,
                       generator: torch.Generator) -> QueuedPrefill:
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
        rows = [s.tokens for s in decoding] + [g.prompt for g in completed for _ in range(g.samples)]
        tokens, logprobs = sample(logits, row_settings(params, rows, logits.shape[-1], self.runner.device), generator,
                                  triton=self.runner.triton)
        return QueuedPrefill(decoding, completed, TokensInFlight(tokens, logprobs))

    def _take_samples(self, queued: QueuedPrefill, params: SamplingParams, stops: set[int]) -> list[Sequence]:
        """A queued prefill step's tokens read: appended to the sequences it decoded, and each prompt it
        completed forked into its samples (returned)."""
        if queued.samples is None:
            return []
        tokens, logprobs = queued.samples.read()
        tokens = [int(t) for t in tokens]
        decoding = queued.decoding
        self._append(decoding, tokens[: len(decoding)], logprobs[: len(decoding)], stops)
        sequences, first = [], len(decoding)
        for group in queued.completed:
            picked = slice(first, first + group.samples)
            sequences += self.scheduler.fork(group, params, tokens[picked], logprobs[picked], stops)
            first += group.samples
        self.stats.generated_tokens += len(sequences)
        return sequences

    def _decode(self, running: list[Sequence], params: SamplingParams, generator: torch.Generator, stops: set[int],
                finish: Callable[[Sequence], None], go_on: Callable[[int], bool]) -> list[Sequence]:
        """Decode steps back to back; the sequences still running when they stop (each one that
        finished is passed to ``finish``). Each step is planned while the device runs the one before;
        its input tokens stay on the device (with ``overlap_steps`` off the host reads each step's
        tokens before queueing the next). A sequence that finishes leaves the batch of the next step
        while ``go_on(sequences left)``, else ends the call (the caller admits waiting prompts): the
        device goes on without waiting for the host to plan a new batch from scratch (in RL
        rollouts, where samples end at every length, that was a gap in most steps). A step queued
        before the host read the finish still computes the finished row; its token is dropped."""
        overlap = self.options.overlap_steps
        batch, in_flight, row_params, leaving = running, deque(), None, []
        self.stats.most_running = max(self.stats.most_running, len(batch))
        ids: np.ndarray | torch.Tensor = np.array([s.tokens[-1] for s in batch])
        step = self.planner.plan(batch)
        while True:
            logits = self.runner.decode(ids, step)
            if row_params is None:  # fixed for the batch; a smaller batch takes its rows
                row_params = row_settings(params, [s.tokens for s in batch], logits.shape[-1], self.runner.device)
            tokens, logprobs = sample(logits[: len(batch)], row_params, generator, triton=self.runner.triton)
            if row_params.seen is not None:  # the repetition penalty's tokens so far, kept current on the device
                row_params.seen.scatter_(1, tokens[:, None], True)
            in_flight.append((batch, TokensInFlight(tokens, logprobs)))
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
                ended |= self._read(in_flight.popleft(), stops)
            for seq in leaving:  # left the batch before the step just read, which gave their last token
                finish(seq)
            leaving = []
            if planned and not ended:
                ids = tokens if overlap else np.array([s.tokens[-1] for s in batch])
                continue
            going_on = [not s.done and len(s.tokens) + len(in_flight) < s.max_len for s in batch]
            stay = [row for row, on in enumerate(going_on) if on]
            smaller = [batch[row] for row in stay]
            if not (smaller and go_on(len(smaller)) and self.scheduler.grow(smaller, len(in_flight) + 1)):
                break  # the steps still queued are read below
            leaving = [s for s, on in zip(batch, going_on, strict=True) if not on]
            step = self.planner.plan(smaller, ahead=len(in_flight))
            rows = self.runner.on_device(np.array(stay))
            ids = tokens[rows] if in_flight else np.array([s.tokens[-1] for s in smaller])
            row_params, batch = row_params.rows(rows), smaller
        while in_flight:
            self._read(in_flight.popleft(), stops)
        for seq in leaving + [s for s in batch if s.done]:
            finish(seq)
        self.stats.decode_prepare_seconds = self.planner.prepare_seconds
        return [s for s in batch if not s.done]

    def _read(self, step: tuple[list[Sequence], TokensInFlight], stops: set[int]) -> bool:
        """A queued step's tokens onto the sequences it ran; whether any sequence finished."""
        batch, samples = step
        return self._append(batch, *samples.read(), stops)

    def _append(self, running: list[Sequence], tokens: list[float], logprobs: list[float], stops: set[int]) -> bool:
        """One step's tokens onto the unfinished sequences; whether any sequence finished."""
        finished = False
        for seq, token, logprob in zip(running, tokens, logprobs, strict=True):
            if seq.done:
                continue
            seq.append(int(token), logprob, stops)
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
    step, and ``read`` waits for it alone (not for the steps queued after it)."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        self.copy = HostCopy(torch.stack((tokens.to(logprobs.dtype), logprobs)))  # token ids are exact in fp32

    def read(self) -> tuple[list[float], list[float]]:
        tokens, logprobs = self.copy.tolist()
        return tokens, logprobs


def row_settings(params: SamplingParams, rows: list[list[int]], vocab: int, device: torch.device) -> RowParams:
    """Per-row settings for ``rows`` (each row's tokens so far, which the repetition penalty
    reads; it applies to greedy rows too, as in transformers)."""
    count = len(rows)
    seen = seen_tokens(rows, vocab, device) if params.repetition_penalty != 1.0 else None
    return RowParams(temperature=torch.full((count,), params.temperature, device=device),
                     top_k=torch.full((count,), params.top_k, device=device, dtype=torch.long),
                     top_p=torch.full((count,), params.top_p, device=device),
                     any_top_k=params.top_k > 0 and not params.greedy,
                     any_top_p=params.top_p < 1 and not params.greedy,
                     min_p=0.0 if params.greedy else params.min_p,
                     repetition_penalty=params.repetition_penalty, seen=seen)
