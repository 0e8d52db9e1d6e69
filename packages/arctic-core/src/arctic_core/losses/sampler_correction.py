"""Correcting for the sampler: importance weights between the policy the loss treats as the data's
(the old log-probs) and the engine that sampled it (``batch.sampling_logprobs``).

A sampler is another engine than the trainer (vLLM's kernels, another dtype, a stale copy), so
its probabilities differ a little from the trainer's for the same weights; weighing each token's
policy loss by ``exp(old - sampling)``, truncated (TIS) or masked outside a band (MIS), corrects the
gradient for that mismatch (TRL's ``vllm_importance_sampling_correction``, verl's ``rollout_is``,
SkyRL's ``off_policy_correction``).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from pydantic import Field, model_validator

from arctic_core.batch import RolloutBatch
from arctic_core.config import StrictModel
from arctic_core.errors import BatchError
from arctic_core.losses.aggregation import extreme, token_mean
from arctic_core.plugins.interfaces import LossContext, Metrics


class SamplerCorrection(StrictModel):
    mode: Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"] = "sequence-mask"
    """token: a weight per token, ``exp(old - sampling)``; sequence: one per sequence, the product
    of its tokens' (every token carries it). truncate: clamped to [low, high]; mask: 0 outside it."""
    low: Annotated[float, Field(ge=0)] | None = None
    """The band's lower end (None: none)."""
    high: Annotated[float, Field(gt=0)] | None = 3.0
    """The band's upper end (None: none)."""

    @model_validator(mode="after")
    def _band_in_order(self) -> SamplerCorrection:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"sampler_correction: low {self.low} is above high {self.high}")
        return self


def sampler_weights(correction: SamplerCorrection, batch: RolloutBatch, old: torch.Tensor, term: str,
                    ctx: LossContext) -> tuple[torch.Tensor, Metrics]:
    """The detached weights (``[B, Lr]`` per token, ``[B, 1]`` per sequence) and their metrics: the
    mean and largest ``|old - sampling|``, the weights' mean, smallest and largest."""
    if batch.sampling_logprobs is None:
        raise BatchError(f"loss {term!r} with sampler_correction needs batch.sampling_logprobs (the sampler's "
                         "log-probs of its tokens)")
    mask = batch.loss_mask
    # A token the sampler could not score (NaN) gets no correction: a log difference of 0.
    diff = torch.nan_to_num((old.detach() - batch.sampling_logprobs.float()) * mask, nan=0.0)
    per_sequence = correction.mode.startswith("sequence")
    weight = torch.exp(diff.sum(-1, keepdim=True) if per_sequence else diff)
    low = -math.inf if correction.low is None else correction.low
    high = math.inf if correction.high is None else correction.high
    if correction.mode.endswith("truncate"):
        weight = weight.clamp(min=low, max=high)
    else:
        weight = weight.masked_fill((weight < low) | (weight > high), 0.0)
    counted = torch.ones_like(weight, dtype=torch.bool) if per_sequence else mask
    mean = weight[:, 0].sum() / ctx.num_sequences if per_sequence else token_mean(weight, mask, ctx)
    metrics = {"sampler_logp_diff": token_mean(diff.abs(), mask, ctx),
               "sampler_logp_diff_max": extreme(diff.abs(), mask, largest=True),
               "sampler_weight": mean, "sampler_weight_min": extreme(weight, counted, largest=False),
               "sampler_weight_max": extreme(weight, counted, largest=True)}
    return weight, metrics
