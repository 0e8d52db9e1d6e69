"""SkyRL's inference client, served by Arctic's samplers.

SkyRL's generator (``SkyRLGymGenerator``: its environments, multi-turn loop and rewards) calls
``generate`` token-in/token-out: once per trajectory turn with one prompt, or once with the whole
batch (``generator.batched``). Per-trajectory calls reach Arctic regrouped into prompt groups
(:class:`~arctic_core.adapters.request_grouping.RequestGrouper`); a batched call is grouped as it
is. The engine-management calls (sleep, wake, pause, prefix-cache resets, weight pushes) are
Arctic's own business: the server puts engines to sleep and pushes weights itself.
"""

from __future__ import annotations

import functools
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.base import (InferenceEngineInput, InferenceEngineInterface,
                                                                InferenceEngineOutput)

from arctic_core.adapters import refusals as reasons
from arctic_core.adapters.sampling import GroupedSampler, end_of_sequence_ids
from arctic_core.adapters.settings import BackendSettings
from arctic_core.adapters.translation import finish_reason
from arctic_core.batch import RolloutBatch
from arctic_core.config import SamplingParams
from arctic_skyrl.mapping import to_sampling_params

TOKEN_IN_TOKEN_OUT = ("arctic-skyrl serves token-in/token-out generation (SkyRLGymGenerator); the OpenAI-style "
                      "HTTP endpoints are not served")


class ArcticInferenceClient(InferenceEngineInterface):
    """Generation through an :class:`~arctic_core.client.AsyncArcticClient`; ``connect`` makes one
    per event loop."""

    def __init__(self, connect, tokenizer, model_path: str, default_sampling: dict[str, Any],
                 settings: BackendSettings) -> None:
        self.tokenizer, self.model_path = tokenizer, model_path
        self.default_sampling = default_sampling
        self.sampler = GroupedSampler.from_settings(connect, settings)

    # ------------------------------------------------------------------ generation
    @property
    def model_name(self) -> str:
        return self.model_path

    @functools.cached_property
    def eos_token_ids(self) -> set[int]:
        return end_of_sequence_ids(self.model_path, self.tokenizer.eos_token_id)

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        if input_batch.get("prompts") is not None:
            raise ValueError(f"{TOKEN_IN_TOKEN_OUT}: send prompt_token_ids")
        if input_batch.get("mm_features") or input_batch.get("return_sample_support"):
            raise ValueError("arctic-skyrl samples text only, without sample-support capture")
        prompts = [list(p) for p in input_batch["prompt_token_ids"]]
        params, want_logprobs = to_sampling_params(dict(input_batch.get("sampling_params") or self.default_sampling))
        if len(prompts) == 1:  # one trajectory's turn: regrouped with its siblings
            samples = [await self.sampler.sample(prompts[0], params)]
        else:  # a whole batch: each distinct prompt once, n = its copies, sent now
            samples = await self.sampler.sample_batch(prompts, params)
        return self._output(samples, params, want_logprobs)

    def _output(self, samples: list[tuple[RolloutBatch, int]], params: SamplingParams,
                want_logprobs: bool) -> InferenceEngineOutput:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        ids = [batch.response(row) for batch, row in samples]
        logprobs = None
        if want_logprobs:
            logprobs = [batch.sampling_logprobs[row, :len(tokens)].tolist()
                        for (batch, row), tokens in zip(samples, ids, strict=True)]
        return InferenceEngineOutput(
            responses=self.tokenizer.batch_decode(ids, skip_special_tokens=True),
            response_ids=ids,
            stop_reasons=[finish_reason(t, params.max_tokens, stops) for t in ids],
            response_logprobs=logprobs, prompt_logprobs=None, rollout_expert_indices=None,
            rollout_sample_support=None)

    # ------------------------------------------------------------------ engine management
    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        """Arctic wakes the engine a call needs (``colocate``)."""

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        """Arctic puts engines to sleep itself (``colocate``)."""

    async def pause_generation(self) -> None:
        """Generation and training alternate here: nothing runs while SkyRL would pause."""

    async def resume_generation(self) -> None:
        """See :meth:`pause_generation`."""

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Arctic's samplers keep no cache across calls of different weights."""

    async def finish_session(self, session_id: str) -> None:
        """No session routing: one backend serves every trajectory."""

    async def teardown(self) -> None:
        await self.sampler.aclose()

    async def get_world_size(self) -> tuple[int, int]:
        return 1, 1

    async def update_named_weights(self, request: Any):
        raise NotImplementedError("arctic-skyrl: weights reach the samplers through Arctic's sync_weights")

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        raise NotImplementedError(f"arctic-skyrl: {reasons.FULL_WEIGHTS}")

    def get_endpoint_url(self) -> str:
        raise NotImplementedError(TOKEN_IN_TOKEN_OUT)

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(TOKEN_IN_TOKEN_OUT)

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(TOKEN_IN_TOKEN_OUT)

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(TOKEN_IN_TOKEN_OUT)
