"""Policy-gradient surrogates: PPO/GRPO clipping (with clip-higher and dual-clip) and GSPO.

Both read ``outputs["logprobs"]`` (current policy, with gradient), ``batch.old_logprobs`` (the
policy that produced the data) and ``batch.advantages`` (per response or per token).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import torch
from pydantic import Field, model_validator

from arctic_core.batch import RolloutBatch
from arctic_core.config import StrictModel
from arctic_core.errors import BatchError
from arctic_core.plugins.interfaces import LossContext
from arctic_core.losses.aggregation import Aggregation, aggregate, token_mean
from arctic_core.losses.options import parse_options


class ClipOptions(StrictModel):
    clip_low: Annotated[float, Field(ge=0)] = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: Annotated[float, Field(ge=0)] | None = Field(None, description="Clipped above at 1 + clip_high; "
                                                             "defaults to clip_low; DAPO uses 0.28.")
    aggregation: Aggregation = "token-mean"
    """How per-token losses become one number (token-mean, seq-mean-token-mean, ...-sum, ...-sum-norm)."""
    old_logprobs: Literal["batch", "current"] = Field(
        "batch", description="batch: batch.old_logprobs; current: the data is on-policy (sampled by exactly "
        "these weights), so the current log-probs, detached, serve (ratio 1, policy-gradient direction).")

    @property
    def high(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high


class PPOOptions(ClipOptions):
    dual_clip: Annotated[float, Field(gt=1)] | None = Field(
        None, description="Dual-clip constant c > 1: caps the loss of negative-advantage tokens at -c*A."
    )


class GSPOOptions(ClipOptions):
    clip_low: Annotated[float, Field(ge=0)] = 3e-4
    """The sequence ratio is clipped below at 1 - clip_low (GSPO's ratios stay near 1)."""
    clip_high: Annotated[float, Field(ge=0)] | None = 4e-4
    """Clipped above at 1 + clip_high."""
    aggregation: Aggregation = "seq-mean-token-mean"
    """GSPO is exact only as a mean over sequences of their token means."""

    @model_validator(mode="after")
    def _sequence_level(self) -> GSPOOptions:
        if self.aggregation != "seq-mean-token-mean":
            raise ValueError("GSPO's ratio is per sequence; only seq-mean-token-mean aggregation is exact")
        return self


def _old_logprobs(batch: RolloutBatch, term: str, logp: torch.Tensor, source: str) -> torch.Tensor:
    if source == "current":
        return logp.detach()
    if batch.old_logprobs is None:
        raise BatchError(f"loss {term!r} needs batch.old_logprobs (log-probs of the policy that sampled the data)")
    return batch.old_logprobs.float()


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1-low, 1+high))`` and where the clipped branch was taken."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


class PPOLoss:
    """PPO/GRPO clipped surrogate with separate low/high clip (DAPO clip-higher) and dual-clip."""

    options_model = PPOOptions
    requires = ("logprobs",)

    def __init__(self, **options: object) -> None:
        self.options = parse_options(self.options_model, "ppo", dict(options))

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        opts, mask = self.options, batch.loss_mask
        logp = outputs["logprobs"]
        adv = batch.token_advantages().to(logp)
        log_ratio = (logp - _old_logprobs(batch, "ppo", logp, opts.old_logprobs)).masked_fill(~mask, 0.0)
        ratio = torch.exp(log_ratio)
        losses, clipped = _clipped_surrogate(ratio, adv, opts.clip_low, opts.high)
        dual = torch.zeros_like(clipped)
        if opts.dual_clip is not None:
            cap = -adv * opts.dual_clip
            dual = (adv < 0) & (losses > cap)
            losses = torch.where(dual, cap, losses)
        loss = aggregate(losses, mask, ctx, opts.aggregation)
        metrics = {
            "clipfrac": token_mean(clipped.float(), mask, ctx),
            "dual_clipfrac": token_mean(dual.float(), mask, ctx),
            "approx_kl": token_mean(0.5 * log_ratio.detach() ** 2, mask, ctx),
        }
        return loss, metrics


class GSPOLoss:
    """GSPO: one length-normalised importance ratio per sequence, clipped per sequence."""

    options_model = GSPOOptions
    requires = ("logprobs",)

    def __init__(self, **options: object) -> None:
        self.options = parse_options(self.options_model, "gspo", dict(options))

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        opts, mask = self.options, batch.loss_mask
        logp = outputs["logprobs"]
        adv = batch.token_advantages().to(logp)
        fmask = mask.to(logp.dtype)
        log_ratio = (logp - _old_logprobs(batch, "gspo", logp, self.options.old_logprobs)) * fmask
        seq_log_ratio = log_ratio.sum(-1) / fmask.sum(-1).clamp(min=1)
        # s_i,t = sg(s_i) * pi_t / sg(pi_t): value s_i for every token, gradient s_i * grad(log pi_t) / |y_i|
        # once aggregated per sequence, which is GSPO's sequence-level gradient.
        token_log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()
        ratio = torch.exp(token_log_ratio)
        losses, clipped = _clipped_surrogate(ratio, adv, opts.clip_low, opts.high)
        loss = aggregate(losses, mask, ctx, opts.aggregation)
        metrics = {
            "clipfrac": token_mean(clipped.float(), mask, ctx),
            "seq_ratio_mean": float(torch.exp(seq_log_ratio.detach()).sum()) / ctx.num_sequences,
        }
        return loss, metrics
