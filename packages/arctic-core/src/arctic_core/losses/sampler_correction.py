"""Correcting for the sampler: importance weights between the policy the loss treats as the data's
(the old log-probs) and the engine that sampled it (``batch.sampling_logprobs``).

A sampler is another engine than the trainer (vLLM's kernels, another dtype, a stale copy), so
its probabilities differ a little from the trainer's for the same weights; weighing each token's
policy loss by ``exp(old - sampling)``, truncated (TIS) or masked outside a band (MIS), corrects the
gradient for that mismatch (TRL's ``vllm_importance_sampling_correction``, verl's ``rollout_is``,
SkyRL's ``off_policy_correction``). Rejections go further: a token, or a whole sequence, whose
weights leave a band drops out of the policy term (SkyRL's outlier, token and sequence masks).
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


class Band(StrictModel):
    """Weights in ``[low, high]`` (None: no bound on that side) are inside."""

    low: Annotated[float, Field(ge=0)] | None = None
    """The band's lower end (None: none)."""
    high: Annotated[float, Field(gt=0)] | None = None
    """The band's upper end (None: none)."""

    @model_validator(mode="after")
    def _in_order(self) -> Band:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low {self.low} is above high {self.high}")
        return self

    @property
    def bounds(self) -> tuple[float, float]:
        return -math.inf if self.low is None else self.low, math.inf if self.high is None else self.high

    def outside(self, weight: torch.Tensor) -> torch.Tensor:
        low, high = self.bounds
        return (weight < low) | (weight > high)


class SequenceBand(Band):
    statistic: Literal["product", "geometric"] = "product"
    """product: the product of the sequence's token weights; geometric: their geometric mean."""


class SamplerCorrection(Band):
    """The weights' own band is ``[low, high]`` (by default no lower end, 3 above)."""

    mode: Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask", "none"] = "sequence-mask"
    """token: a weight per token, ``exp(old - sampling)``; sequence: one per sequence, the product
    of its tokens' (every token carries it). truncate: clamped to [low, high]; mask: 0 outside it;
    none: no weight (only the rejections below)."""
    high: Annotated[float, Field(gt=0)] | None = 3.0
    """The band's upper end (None: none)."""
    reject_sequences_with_token: Band | None = None
    """A sequence with any token's weight outside this band leaves the policy term (SkyRL's outlier mask)."""
    reject_tokens: Band | None = None
    """A token whose weight is outside this band leaves the policy term (SkyRL's token mask)."""
    reject_sequences: SequenceBand | None = None
    """A sequence whose weight (product or geometric mean over the tokens the rules above keep) is
    outside this band leaves the policy term (SkyRL's sequence mask)."""

    @property
    def rejects(self) -> bool:
        return any(rule is not None for rule in (self.reject_sequences_with_token, self.reject_tokens,
                                                 self.reject_sequences))


def sampler_weights(correction: SamplerCorrection, batch: RolloutBatch, old: torch.Tensor, term: str,
                    ctx: LossContext) -> tuple[torch.Tensor, Metrics]:
    """The detached weights (``[B, Lr]`` per token or with rejections, ``[B, 1]`` per sequence) and
    their metrics: the mean and largest ``|old - sampling|``, the weights' mean, smallest and
    largest, and the share of loss tokens rejected.

    A rejected token weighs 0 and still counts in the aggregation's normaliser, as SkyRL's masks do.
    The token rules read the call's loss mask; a sequence's weight and the sequence rule count only
    the tokens those rules keep."""
    if batch.sampling_logprobs is None:
        raise BatchError(f"loss {term!r} with sampler_correction needs batch.sampling_logprobs (the sampler's "
                         "log-probs of its tokens)")
    mask = batch.loss_mask
    # A token the sampler could not score (NaN) gets no correction: a log difference of 0.
    diff = torch.nan_to_num((old.detach() - batch.sampling_logprobs.float()) * mask, nan=0.0)
    token_weight = torch.exp(diff)
    keep = _kept(correction, token_weight, mask)
    kept_diff = diff * keep
    metrics = {"sampler_logp_diff": token_mean(diff.abs(), mask, ctx),
               "sampler_logp_diff_max": extreme(diff.abs(), mask, largest=True)}
    if correction.mode != "none":
        weight, weight_metrics = _importance_weights(correction, token_weight, kept_diff, mask, ctx)
        metrics.update(weight_metrics)
    else:
        weight = torch.ones_like(diff[:, :1])
    if correction.rejects:
        keep = keep & ~_rejected_sequences(correction.reject_sequences, kept_diff, keep)
        metrics["sampler_rejected"] = token_mean((mask & ~keep).to(diff.dtype), mask, ctx)
        weight = weight * keep
    return weight, metrics


def _kept(correction: SamplerCorrection, token_weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The loss tokens the token rules keep (bool ``[B, Lr]``)."""
    keep = mask
    if correction.reject_sequences_with_token is not None:
        outlier = correction.reject_sequences_with_token.outside(token_weight) & mask
        keep = keep & ~outlier.any(-1, keepdim=True)
    if correction.reject_tokens is not None:
        keep = keep & ~correction.reject_tokens.outside(token_weight)
    return keep


def _rejected_sequences(rule: SequenceBand | None, kept_diff: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The sequences (bool ``[B, 1]``) whose product or geometric mean of kept weights is outside the band."""
    if rule is None:
        return torch.zeros_like(keep[:, :1])
    log_weight = kept_diff.sum(-1, keepdim=True)
    if rule.statistic == "geometric":
        log_weight = log_weight / keep.sum(-1, keepdim=True).clamp(min=1)
    return rule.outside(torch.exp(log_weight))


def _importance_weights(correction: SamplerCorrection, token_weight: torch.Tensor, kept_diff: torch.Tensor,
                        mask: torch.Tensor, ctx: LossContext) -> tuple[torch.Tensor, Metrics]:
    per_sequence = correction.mode.startswith("sequence")
    weight = torch.exp(kept_diff.sum(-1, keepdim=True)) if per_sequence else token_weight
    if correction.mode.endswith("truncate"):
        weight = weight.clamp(*correction.bounds)
    else:
        weight = weight.masked_fill(correction.outside(weight), 0.0)
    counted = torch.ones_like(weight, dtype=torch.bool) if per_sequence else mask
    mean = weight[:, 0].sum() / ctx.num_sequences if per_sequence else token_mean(weight, mask, ctx)
    return weight, {"sampler_weight": mean, "sampler_weight_min": extreme(weight, counted, largest=False),
                    "sampler_weight_max": extreme(weight, counted, largest=True)}
