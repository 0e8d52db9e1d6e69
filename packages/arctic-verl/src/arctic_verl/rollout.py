"""verl's rollout on Arctic: an LLM client that regroups verl's per-sample requests.

verl's agent loop asks for one sample per call: for a batch of prompts with ``rollout.n = 8`` it
makes 8 calls per prompt with the same prompt ids, one after another. Arctic samples a prompt's
group together (the embedded sampler reads the shared prompt's KV cache once per group, and one
large call keeps its batch full), so the client gathers calls until they stop arriving, sends each
distinct prompt once with ``n`` = its number of calls, and hands every caller one of the samples.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from omegaconf import DictConfig
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from arctic_core.batch import RolloutBatch
from arctic_core.config import SamplingParams
from arctic_verl.backend import BackendAddress
from arctic_verl.mapping import to_sampling_params
from arctic_verl.settings import ArcticSettings

Send = Callable[[list[list[int]], SamplingParams], Awaitable[RolloutBatch]]
Sample = tuple[RolloutBatch, int]  # a generated batch and the row of one caller's sample


class RequestGrouper:
    """Gathers single-sample requests until none has arrived for ``quiet_s`` seconds (or
    ``max_wait_s`` after the first), then sends one ``generate`` per (sampling params, samples per
    prompt): each distinct prompt once, with ``n`` samples."""

    def __init__(self, send: Send, quiet_s: float, max_wait_s: float) -> None:
        self.send, self.quiet_s, self.max_wait_s = send, quiet_s, max_wait_s
        self.pending: dict[str, dict[tuple[int, ...], list[asyncio.Future[Sample]]]] = defaultdict(lambda: defaultdict(list))
        self.params: dict[str, SamplingParams] = {}
        self.flusher: asyncio.Task | None = None
        self.submitted = 0

    async def submit(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        key = params.model_dump_json()
        self.params[key] = params
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Sample] = loop.create_future()
        self.pending[key][tuple(prompt_ids)].append(future)
        self.submitted += 1
        if self.flusher is None:
            self.flusher = asyncio.ensure_future(self._flush_when_quiet())
        return await future

    async def _flush_when_quiet(self) -> None:
        # verl's agent loop issues a batch's requests one by one over a while: wait for a whole
        # quiet period with no new request (counted, not timed: a stalled event loop or a slow
        # tokenizer thread must not pass for a lull).
        loop = asyncio.get_running_loop()
        latest = loop.time() + self.max_wait_s
        while True:
            seen = self.submitted
            await asyncio.sleep(max(0.0, min(self.quiet_s, latest - loop.time())))
            if self.submitted == seen or loop.time() >= latest:
                break
        await self.flush()

    async def flush(self) -> None:
        pending, self.pending, self.flusher = self.pending, defaultdict(lambda: defaultdict(list)), None
        params, self.params = self.params, {}
        calls = []
        for key, by_prompt in pending.items():
            by_count: dict[int, dict[tuple[int, ...], list[asyncio.Future[Sample]]]] = defaultdict(dict)
            for prompt, futures in by_prompt.items():
                by_count[len(futures)][prompt] = futures
            calls += [self._generate(group, params[key].model_copy(update={"n": n})) for n, group in by_count.items()]
        await asyncio.gather(*calls)

    async def _generate(self, group: dict[tuple[int, ...], list[asyncio.Future[Sample]]], params: SamplingParams) -> None:
        try:
            batch = await self.send([list(p) for p in group], params)
        except Exception as exc:  # every caller of this call learns why
            for futures in group.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            return
        rows_of = batch.groups()  # rows of each prompt, in prompt order
        for futures, rows in zip(group.values(), rows_of, strict=True):
            for future, row in zip(futures, rows, strict=True):
                if not future.done():
                    future.set_result((batch, row))


class ArcticLLMClient(LLMServerClient):
    """verl's LLM client, served by Arctic: sampling at verl's settings, the sampler's log-probs
    when asked, and the trainer step whose weights sampled each response (``global_steps``)."""

    def __init__(self, config: DictConfig, address: BackendAddress, step_offset: int, settings: ArcticSettings) -> None:
        super().__init__(config=config, load_balancer_handle=None)
        self.address, self.step_offset = address, step_offset
        self.quiet_s, self.max_wait_s = settings.group_quiet_ms / 1000.0, settings.group_max_wait_ms / 1000.0
        self.response_length = int(config.actor_rollout_ref.rollout.response_length)
        self._grouper: RequestGrouper | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __getstate__(self) -> dict[str, Any]:  # sent to verl's agent-loop workers: no live connection
        return {**self.__dict__, "_grouper": None, "_loop": None}

    def grouper(self) -> RequestGrouper:
        loop = asyncio.get_running_loop()
        if self._grouper is None or self._loop is not loop:  # a connection belongs to its event loop
            client = self.address.async_client()

            async def send(prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
                return (await client.generate(prompts, params)).batch

            self._grouper, self._loop = RequestGrouper(send, self.quiet_s, self.max_wait_s), loop
        return self._grouper

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise ValueError("arctic-verl samples text only: image, video and audio inputs are not supported")
        params, want_logprobs = to_sampling_params(dict(sampling_params), self.response_length)
        batch, row = await self.grouper().submit(list(prompt_ids), params)
        length = int(batch.response_lens[row])
        log_probs = batch.sampling_logprobs[row, :length].tolist() if want_logprobs and batch.sampling_logprobs is not None else None
        step = int(batch.policy_version[row]) - self.step_offset if batch.policy_version is not None else 0
        return TokenOutput(token_ids=batch.response(row), log_probs=log_probs, stop_reason="completed",
                           extra_fields={"global_steps": step, "min_global_steps": step, "max_global_steps": step})
