"""The sampling side of an adapter: the framework's generate calls, grouped, on the backend's client.

A framework's inference client answers its generate calls in an event loop of its own (several,
over a run: each agent-loop worker, each asyncio.run). A connection belongs to the loop that
opened it, so :class:`GroupedSampler` keeps one client and one
:class:`~arctic_core.adapters.request_grouping.RequestGrouper` per loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from arctic_core.adapters.request_grouping import RequestGrouper, Sample
from arctic_core.adapters.settings import BackendSettings
from arctic_core.batch import RolloutBatch
from arctic_core.client import AsyncArcticClient
from arctic_core.config import SamplingParams
from arctic_core.hf import generation_config, token_id_list


class GroupedSampler:
    """Single-sample (and batched) generate calls through one client and grouper per event loop;
    ``connect`` opens a client. Picklable: what is sent to another process reconnects there."""

    def __init__(self, connect: Callable[[], AsyncArcticClient], quiet_s: float, max_wait_s: float) -> None:
        self.connect, self.quiet_s, self.max_wait_s = connect, quiet_s, max_wait_s
        self._client: AsyncArcticClient | None = None
        self._grouper: RequestGrouper | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_settings(cls, connect: Callable[[], AsyncArcticClient], settings: BackendSettings) -> GroupedSampler:
        return cls(connect, settings.group_quiet_ms / 1000.0, settings.group_max_wait_ms / 1000.0)

    def __getstate__(self) -> dict[str, Any]:  # no live connection crosses a process boundary
        return {**self.__dict__, "_client": None, "_grouper": None, "_loop": None}

    def grouper(self) -> RequestGrouper:
        """The grouper of the running event loop (opened on its first call there)."""
        loop = asyncio.get_running_loop()
        if self._grouper is None or self._loop is not loop:
            self._client, self._loop = self.connect(), loop
            self._grouper = RequestGrouper(self._send, self.quiet_s, self.max_wait_s)
        return self._grouper

    async def _send(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        return (await self._client.generate(prompts, params)).batch

    async def sample(self, prompt: list[int], params: SamplingParams) -> Sample:
        """One sample of ``prompt``, sent with the other requests of its prompt group; with a quiet
        time of 0, sent as it comes (the server's sampler joins calls for one prompt itself)."""
        grouper = self.grouper()
        if self.quiet_s == 0:
            return await self._send([prompt], params), 0
        return await grouper.submit(prompt, params)

    async def sample_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        """A sample of each of ``prompts``, sent now (each distinct prompt once)."""
        return await self.grouper().submit_batch(prompts, params)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        self._client = self._grouper = self._loop = None


def end_of_sequence_ids(model_path: str, tokenizer_eos: int | list[int] | None) -> set[int]:
    """What ends a sample besides a request's stop ids, as in vLLM: the tokenizer's end-of-sequence
    id and those of the model's generation config (a chat model often lists several)."""
    config = generation_config(model_path)
    return set(token_id_list(tokenizer_eos)) | set(token_id_list(config.eos_token_id if config else None))
