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


class AggregationOptions(StrictModel):
    aggregation: Aggregation = "token-mean"
    """How per-token values become one number (token-mean, seq-mean-token-mean, ...-sum, ...-sum-norm)."""


class KLOptions(AggregationOptions):
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimators of KL(policy || reference) from the policy's samples (k3: low variance, >= 0)."""
    clamp: Annotated[float, Field(gt=0)] | None = Field(
        10.0, description="Clamp the per-token estimate to [-clamp, clamp] for stability; None disables."
    )


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimates of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logp - ref_logp  # log pi/ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) - 1.0 + log_ratio  # k3: r - 1 - log r with r = ref/pi


class KLLoss:
    """KL penalty to the reference policy (k1, k2 or k3 estimator); needs batch.ref_logprobs."""

    options_model = KLOptions
    requires = ("logprobs",)

    def __init__(self, **options: object) -> None:
        self.options = parse_options(self.options_model, "kl", dict(options))

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if batch.ref_logprobs is None:
            raise BatchError("loss 'kl' needs batch.ref_logprobs (reference-model log-probs)")
        kl = kl_estimate(outputs["logprobs"], batch.ref_logprobs.float(), self.options.estimator)
        if self.options.clamp is not None:
            kl = kl.clamp(-self.options.clamp, self.options.clamp)
        mask = batch.loss_mask
        return aggregate(kl, mask, ctx, self.options.aggregation), {"kl": token_mean(kl, mask, ctx)}


class EntropyBonus:
    """Entropy bonus: minimises -entropy, so a positive weight raises the policy's entropy."""

    options_model = AggregationOptions
    requires = ("entropy",)

    def __init__(self, **options: object) -> None:
        self.options = parse_options(self.options_model, "entropy", dict(options))

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        entropy, mask = outputs["entropy"], batch.loss_mask
        loss = -aggregate(entropy, mask, ctx, self.options.aggregation)
        return loss, {"entropy": token_mean(entropy, mask, ctx)}


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
