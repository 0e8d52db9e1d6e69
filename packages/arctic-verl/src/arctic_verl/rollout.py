"""verl's rollout on Arctic: an LLM client that regroups verl's per-sample requests.

verl's agent loop asks for one sample per call (for ``rollout.n = 8``, 8 calls per prompt with the
same prompt ids), from each of its workers (``rollout.agent.num_workers``); the client's
:class:`~arctic_core.adapters.sampling.GroupedSampler` sends a worker's calls to Arctic as prompt
groups, and the server runs every worker's calls in the sampler's shared steps.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from arctic_core.adapters.backend import BackendAddress
from arctic_core.adapters.sampling import GroupedSampler
from arctic_verl.mapping import to_sampling_params
from arctic_verl.settings import ArcticSettings


class ArcticLLMClient(LLMServerClient):
    """verl's LLM client, served by Arctic: sampling at verl's settings, the sampler's log-probs
    when asked, and the trainer step whose weights sampled each response (``global_steps``)."""

    def __init__(self, config: DictConfig, address: BackendAddress, step_offset: int, settings: ArcticSettings) -> None:
        super().__init__(config=config, load_balancer_handle=None)
        self.step_offset = step_offset
        self.sampler = GroupedSampler.from_settings(address.async_client, settings)  # sent to verl's workers
        self.rollout = config.actor_rollout_ref.rollout

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise ValueError("arctic-verl samples text only: image, video and audio inputs are not supported")
        params, want_logprobs = to_sampling_params(sampling_params, self.rollout, len(prompt_ids))
        batch, row = await self.sampler.sample(list(prompt_ids), params)
        length = int(batch.response_lens[row])
        log_probs = (batch.sampling_logprobs[row, :length].tolist()
                     if want_logprobs and batch.sampling_logprobs is not None else None)
        oldest, newest = (int(v[row]) - self.step_offset for v in batch.version_range()) \
            if batch.policy_version is not None else (0, 0)
        # A weight sync while the sample ran: its later tokens are the newer policy's.
        steps = {"global_steps": oldest, "min_global_steps": oldest, "max_global_steps": newest}
        return TokenOutput(token_ids=batch.response(row), log_probs=log_probs, stop_reason="completed",
                           extra_fields=steps)
