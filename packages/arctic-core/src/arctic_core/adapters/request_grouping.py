"""Per-sample rollout requests regrouped into prompt groups.

Frameworks' agent loops ask for one sample per call: for a batch of prompts with ``n`` samples each
they make ``n`` calls per prompt with the same prompt ids, one after another. Arctic samples a
prompt's group together (the embedded sampler reads the shared prompt's KV cache once per group,
and one large call keeps its batch full), so :class:`RequestGrouper` gathers calls until they stop
arriving, sends each distinct prompt once with ``n`` = its number of calls, and hands every caller
one of the samples.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable

from arctic_core.batch import RolloutBatch
from arctic_core.config import SamplingParams

Send = Callable[[list[list[int]], SamplingParams], Awaitable[RolloutBatch]]
Sample = tuple[RolloutBatch, int]  # a generated batch and the row of one caller's sample


class RequestGrouper:
    """Gathers single-sample requests until none has arrived for ``quiet_s`` seconds (or
    ``max_wait_s`` after the first), then sends one ``generate`` per (sampling params, samples per
    prompt): each distinct prompt once, with ``n`` samples."""

    def __init__(self, send: Send, quiet_s: float, max_wait_s: float) -> None:
        self.send, self.quiet_s, self.max_wait_s = send, quiet_s, max_wait_s
        self.pending: dict[str, dict[tuple[int, ...], list[asyncio.Future[Sample]]]]
        self.pending = defaultdict(lambda: defaultdict(list))
        self.params: dict[str, SamplingParams] = {}
        self.flusher: asyncio.Task | None = None
        self.submitted = 0

    def _enqueue(self, prompt_ids: list[int], params: SamplingParams) -> asyncio.Future[Sample]:
        key = params.model_dump_json()
        self.params[key] = params
        future: asyncio.Future[Sample] = asyncio.get_running_loop().create_future()
        self.pending[key][tuple(prompt_ids)].append(future)
        self.submitted += 1
        return future

    async def submit(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        future = self._enqueue(prompt_ids, params)
        if self.flusher is None:
            self.flusher = asyncio.ensure_future(self._flush_when_quiet())
        return await future

    async def submit_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        """Many requests in one call (a framework's batched generate): grouped as :meth:`submit`'s,
        with whatever else is pending, and sent at once; samples in the order of ``prompts``."""
        futures = [self._enqueue(prompt, params) for prompt in prompts]
        if self.flusher is not None:
            self.flusher.cancel()  # this flush sends what it was waiting to send
        await self.flush()
        return list(await asyncio.gather(*futures))

    async def _flush_when_quiet(self) -> None:
        # An agent loop issues a batch's requests one by one over a while: wait for a whole
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

    async def _generate(self, group: dict[tuple[int, ...], list[asyncio.Future[Sample]]],
                        params: SamplingParams) -> None:
        try:
            batch = await self.send([list(p) for p in group], params)
        except Exception as exc:  # noqa: BLE001 (every caller of this call learns why)
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
