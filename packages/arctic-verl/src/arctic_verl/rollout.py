"""verl's rollout on Arctic: an LLM client that regroups verl's per-sample requests.

verl's agent loop asks for one sample per call (for ``rollout.n = 8``, 8 calls per prompt with the
same prompt ids); the client's :class:`~arctic_core.adapters.request_grouping.RequestGrouper` sends
them to Arctic as prompt groups.
"""

from __future__ import annotations

import asyncio
from typing import Any

from omegaconf import DictConfig
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from arctic_core.adapters.request_grouping import RequestGrouper
from arctic_core.batch import RolloutBatch
from arctic_core.config import SamplingParams
from arctic_verl.backend import BackendAddress
from arctic_verl.mapping import to_sampling_params
from arctic_verl.settings import ArcticSettings


class ArcticLLMClient(LLMServerClient):
    """verl's LLM client, served by Arctic: sampling at verl's settings, the sampler's log-probs
    when asked, and the trainer step whose weights sampled each response (``global_steps``)."""

    def __init__(self, config: DictConfig, address: BackendAddress, step_offset: int, settings: ArcticSettings) -> None:
        super().__init__(config=config, load_balancer_handle=None)
        self.address, self.step_offset = address, step_offset
        self.quiet_s, self.max_wait_s = settings.group_quiet_ms / 1000.0, settings.group_max_wait_ms / 1000.0
        self.rollout = config.actor_rollout_ref.rollout
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
        params, want_logprobs = to_sampling_params(sampling_params, self.rollout, len(prompt_ids))
        batch, row = await self.grouper().submit(list(prompt_ids), params)
        length = int(batch.response_lens[row])
        log_probs = batch.sampling_logprobs[row, :length].tolist() if want_logprobs and batch.sampling_logprobs is not None else None
        step = int(batch.policy_version[row]) - self.step_offset if batch.policy_version is not None else 0
        return TokenOutput(token_ids=batch.response(row), log_probs=log_probs, stop_reason="completed",
                           extra_fields={"global_steps": step, "min_global_steps": step, "max_global_steps": step})
