"""Regularising terms: KL to a reference policy, entropy bonus, and SFT cross-entropy.

A term's coefficient is its ``weight`` in the loss list (``{name: kl, weight: 0.001}``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import torch
from pydantic import Field

from arctic_core.batch import RolloutBatch
from arctic_core.config import StrictModel
from arctic_core.errors import BatchError
from arctic_core.plugins.interfaces import LossContext
from arctic_core.losses.aggregation import Aggregation, aggregate, token_mean
from arctic_core.losses.options import parse_options
from arctic_core.losses.ratios import at_level, old_logprobs


class AggregationOptions(StrictModel):
    aggregation: Aggregation = "token-mean"
    """How per-token values become one number (token-mean, seq-mean-token-mean, ...-sum, ...-sum-norm)."""


class KLOptions(AggregationOptions):
    estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    """Schulman's estimators of KL(policy || reference) from the policy's samples (k3: low variance,
    >= 0), or abs: |log policy/reference|."""
    against: Literal["reference", "old"] = "reference"
    """reference: the reference model (batch.ref_logprobs); old: the policy that sampled the data
    (batch.old_logprobs): k2 with weight 2*tau is the squared log-ratio regulariser of Kimi K2.5
    and PRIME-RL, which keeps the trained policy near the sampler's."""
    gradient: Literal["estimator", "k2"] = "estimator"
    """k2: the estimator's value with the k2 estimator's gradient (a straight-through estimate whose
    gradient is the KL's; verl's 'k3+'); estimator: the estimator's own gradient."""
    clamp: Annotated[float, Field(gt=0)] | None = Field(
        10.0, description="Clamp the per-token estimate to [-clamp, clamp] for stability; None disables."
    )
    ratio_weighted: bool = False
    """Weigh each token's estimate by the policy's importance ratio (with its gradient): the KL of
    the current policy when the data came from an older one (TRL's use_bias_correction_kl)."""
    level: Literal["token", "sequence"] = "token"
    """With ratio_weighted: the ratio per token, or per sequence (as the policy term's level)."""
    old_logprobs: Literal["batch", "current"] = "batch"
    """With ratio_weighted: the old log-probs from the batch, or the current ones detached (on-policy)."""


class EntropyOptions(AggregationOptions):
    entropy_floor: float | None = None
    """Only tokens whose entropy is at least this count (the policy term's high-entropy tokens)."""


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimates of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logp - ref_logp  # log pi/ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "abs":
        return log_ratio.abs()
    return torch.exp(-log_ratio) - 1.0 + log_ratio  # k3: r - 1 - log r with r = ref/pi


class KLLoss:
    """KL penalty to the reference policy (k1, k2 or k3 estimator; needs batch.ref_logprobs), or to
    the policy that sampled the data (``against: old``; needs batch.old_logprobs)."""

    options_model = KLOptions
    requires = ("logprobs",)

    def __init__(self, **options: object) -> None:
        self.options = parse_options(self.options_model, "kl", dict(options))

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        opts, logp, mask = self.options, outputs["logprobs"], batch.loss_mask
        ref_logp = self._reference(batch)
        kl = kl_estimate(logp, ref_logp, opts.estimator)
        if opts.clamp is not None:
            kl = kl.clamp(-opts.clamp, opts.clamp)
        if opts.gradient == "k2":
            k2 = kl_estimate(logp, ref_logp, "k2")
            kl = k2 - k2.detach() + kl.detach()
        if opts.ratio_weighted:
            old = old_logprobs(batch, "kl", logp, opts.old_logprobs)
            kl = kl * torch.exp(at_level((logp - old).masked_fill(~mask, 0.0), mask, opts.level))
        return aggregate(kl, mask, ctx, opts.aggregation), {"kl": token_mean(kl, mask, ctx)}  # what is penalised

    def _reference(self, batch: RolloutBatch) -> torch.Tensor:
        if self.options.against == "old":
            if batch.old_logprobs is None:
                raise BatchError("loss 'kl' with against: old needs batch.old_logprobs (the sampling policy's "
                                 "log-probs)")
            return batch.old_logprobs.float()
        if batch.ref_logprobs is None:
            raise BatchError("loss 'kl' needs batch.ref_logprobs (reference-model log-probs)")
        return batch.ref_logprobs.float()


class EntropyBonus:
    """Entropy bonus: minimises -entropy, so a positive weight raises the policy's entropy."""

    options_model = EntropyOptions
    requires = ("entropy",)

    def __init__(self, **options: object) -> None:
        self.options = parse_options(self.options_model, "entropy", dict(options))

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        entropy, mask = outputs["entropy"], batch.loss_mask
        metrics = {"entropy": token_mean(entropy, mask, ctx)}
        if self.options.entropy_floor is not None:
            kept = ((entropy.detach() * mask) >= self.options.entropy_floor) & mask
            entropy = entropy * kept
            metrics["kept"] = token_mean(kept.float(), mask, ctx)
        return -aggregate(entropy, mask, ctx, self.options.aggregation), metrics


class SFTLoss:
    """Supervised cross-entropy on the response tokens (negative log-likelihood)."""

    options_model = AggregationOptions
    requires = ("logprobs",)

    def __init__(self, **options: object) -> None:
        self.options = parse_options(self.options_model, "sft", dict(options))

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        nll, mask = -outputs["logprobs"], batch.loss_mask
        return aggregate(nll, mask, ctx, self.options.aggregation), {"nll": token_mean(nll, mask, ctx)}
