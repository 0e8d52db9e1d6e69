"""Policy-gradient losses over importance ratios: PPO/GRPO clipping (clip-higher, dual clip,
two-sided clip), GSPO (sequence-level ratios), CISPO, SAPO, VESPO and DPPO (a trust region on
the change of each token's probability).

Every term reads ``outputs["logprobs"]`` (the current policy, with gradient), the log-probs of the
policy that produced the data (``batch.old_logprobs``, or the current ones detached when the data
is on-policy) and ``batch.advantages`` (per response or per token). What they share
(:class:`PolicyOptions`):

- ``level``: one importance ratio per token, or one per sequence, ``exp(mean_t log ratio)``, which
  every token of the sequence carries (its gradient reaches all of them);
- ``entropy_floor``: only tokens whose entropy is at least this count in the policy term (high-
  entropy "forking" tokens); the floor is usually a quantile of the batch's entropies;
- ``off_policy_threshold``: a sequence with a negative advantage whose mean KL between the
  data's policy and the current one exceeds this is dropped (DeepSeek-V3.2's off-policy mask);
- ``sampler_correction``: each token's loss weighed by the importance weight between the data's
  policy and the sampler (truncated or masked; see ``arctic_core.losses.sampler_correction``).

Masks multiply the per-token losses; the aggregation keeps normalising by the loss mask, so a
masked token counts as a zero, as in TRL.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Literal

import torch
from pydantic import Field, model_validator

from arctic_core.batch import RolloutBatch
from arctic_core.config import StrictModel
from arctic_core.errors import BatchError
from arctic_core.losses.aggregation import Aggregation, aggregate, extreme, token_mean
from arctic_core.losses.options import parse_options
from arctic_core.losses.ratios import at_level, old_logprobs
from arctic_core.losses.sampler_correction import SamplerCorrection, sampler_weights
from arctic_core.plugins.interfaces import LossContext


class PolicyOptions(StrictModel):
    aggregation: Aggregation = "token-mean"
    """How per-token losses become one number (token-mean, seq-mean-token-mean, ...-sum, ...-sum-norm)."""
    old_logprobs: Literal["batch", "current"] = Field(
        "batch", description="batch: batch.old_logprobs; current: the data is on-policy (sampled by exactly "
        "these weights), so the current log-probs, detached, serve (ratio 1, policy-gradient direction).")
    level: Literal["token", "sequence"] = "token"
    """One importance ratio per token, or one per sequence (the exp of its mean log ratio; GSPO)."""
    sequence_gradient: Literal["mean", "token"] = "mean"
    """With level sequence, where the ratio's gradient goes: through the sequence's mean log ratio
    (the GSPO paper, TRL), or through each token's own log-prob at the sequence ratio's value
    (verl's GSPO). They differ when tokens weigh differently (sampler weights, masks)."""
    entropy_floor: float | None = None
    """Only tokens whose entropy is at least this count in the policy term (needs the entropy processor)."""
    off_policy_threshold: float | None = None
    """Drop a negative-advantage sequence whose mean KL(data's policy || current) exceeds this."""
    off_policy_logprobs: Literal["old", "sampling"] = "old"
    """What that KL compares with: the old log-probs, or the sampler's (batch.sampling_logprobs)."""
    log_ratio_bounds: tuple[float | None, float | None] | None = None
    """Clamp the log importance ratio each token carries to [low, high] before the exp (None: no
    bound on that side); outside the bounds it has no gradient. verl clamps to [-20, 20] for
    stability (its GSPO to [None, 10])."""
    sampler_correction: SamplerCorrection | None = None
    """Weigh each token's loss by exp(old - sampling log-probs), per token or per sequence,
    truncated or masked outside [low, high] (needs batch.sampling_logprobs); None: no correction."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> PolicyOptions:
        low, high = self.log_ratio_bounds or (None, None)
        if low is not None and high is not None and low > high:
            raise ValueError(f"log_ratio_bounds: the low bound {low} is above the high bound {high}")
        return self


class ClipOptions(PolicyOptions):
    clip_low: Annotated[float, Field(ge=0)] = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: Annotated[float, Field(ge=0)] | None = Field(None, description="Clipped above at 1 + clip_high; "
                                                             "defaults to clip_low; DAPO uses 0.28.")
    delta: Annotated[float, Field(gt=1)] | None = None
    """Two-sided clipping: the unclipped ratio is capped at delta too (bounds a negative advantage's loss)."""

    @property
    def high(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high


class PPOOptions(ClipOptions):
    dual_clip: Annotated[float, Field(gt=1)] | None = Field(
        None, description="Dual-clip constant c > 1: caps the loss of negative-advantage tokens at -c*A."
    )


class GSPOOptions(ClipOptions):
    level: Literal["token", "sequence"] = "sequence"
    """GSPO's ratio is per sequence."""
    clip_low: Annotated[float, Field(ge=0)] = 3e-4
    """The sequence ratio is clipped below at 1 - clip_low (GSPO's ratios stay near 1)."""
    clip_high: Annotated[float, Field(ge=0)] | None = 4e-4
    """Clipped above at 1 + clip_high."""
    aggregation: Aggregation = "seq-mean-token-mean"
    """The GSPO paper's mean over sequences of their token means; any other aggregation weighs each
    sequence's loss by its tokens, as TRL's loss types do."""


class CISPOOptions(PolicyOptions):
    ratio_cap: Annotated[float, Field(gt=0)] = 5.0
    """The importance ratio, detached, is capped at this and weighs -A * log-prob (CISPO)."""
    ratio_floor: Annotated[float, Field(ge=0)] | None = None
    """And raised to at least this (verl clips both sides: [1 - clip_low, 1 + clip_high]); None: no floor."""

    @model_validator(mode="after")
    def _floor_below_cap(self) -> CISPOOptions:
        if self.ratio_floor is not None and self.ratio_floor > self.ratio_cap:
            raise ValueError(f"ratio_floor {self.ratio_floor} is above ratio_cap {self.ratio_cap}")
        return self


class SAPOOptions(PolicyOptions):
    temperature_pos: Annotated[float, Field(gt=0)] = 1.0
    """Softness of the gate for positive advantages."""
    temperature_neg: Annotated[float, Field(gt=0)] = 1.05
    """Softness of the gate for negative advantages."""


class VESPOOptions(PolicyOptions):
    k_pos: float = 2.0
    """Gamma weight phi(w) = e^lambda w^k e^(-lambda w) for non-negative advantages ..."""
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    """... and for negative ones."""
    lambda_neg: float = 2.0

    @model_validator(mode="after")
    def _token_level(self) -> VESPOOptions:
        if self.level != "token":
            raise ValueError("VESPO computes its sequence weight itself; level must be 'token'")
        correction = self.sampler_correction
        if correction is not None and (not correction.mode.startswith("token") or correction.rejects):
            raise ValueError("VESPO folds the sampler weights into its sequence weight token by token: "
                             "sampler_correction.mode must be token-truncate or token-mask, without rejections")
        return self


class DPPOOptions(PolicyOptions):
    mask_low: Annotated[float, Field(ge=0)] = 0.2
    """A token whose probability fell by more than this (absolute, p - p_old < -mask_low) leaves the policy term."""
    mask_high: Annotated[float, Field(ge=0)] = 0.2
    """A token whose probability rose by more than this (p - p_old > mask_high) leaves the policy term."""
    trust_region: Literal["advantage-sign", "both-sides"] = "advantage-sign"
    """advantage-sign: a positive-advantage token is dropped only for rising too far, any other only
    for falling too far (DPPO-Binary TV); both-sides: a token is dropped for moving too far either
    way (mask_low and mask_high as the two bounds; IPO)."""


class PolicyTerm:
    """What every policy term does around its surrogate: ratios, masks, aggregation, metrics."""

    name = "policy"
    options_model: type[PolicyOptions] = PolicyOptions
    folds_sampler_weights = False
    """True for a term whose surrogate takes the sampler weights into its own weights (its
    ``surrogate`` gets ``sampler_weights=``); any other's losses are multiplied by them."""

    def __init__(self, **options: object) -> None:
        self.options = parse_options(self.options_model, self.name, dict(options))
        self.requires = ("logprobs", "entropy") if self.options.entropy_floor is not None else ("logprobs",)

    def surrogate(self, ratio: torch.Tensor, log_ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-token losses ``[B, Lr]`` and additive metrics, from the ratios (``[B, Lr]``)."""
        raise NotImplementedError

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        opts, mask = self.options, batch.loss_mask
        logp = outputs["logprobs"]
        adv = batch.token_advantages().to(logp)
        old = old_logprobs(batch, self.name, logp, opts.old_logprobs)
        log_ratio = (logp - old).masked_fill(~mask, 0.0)
        carried = at_level(log_ratio, mask, opts.level, opts.sequence_gradient)
        if opts.log_ratio_bounds is not None:
            carried = carried.clamp(*opts.log_ratio_bounds)
        ratio = torch.exp(carried)
        weights, sampler_metrics = (None, {}) if opts.sampler_correction is None else sampler_weights(
            opts.sampler_correction, batch, old, self.name, ctx)
        if self.folds_sampler_weights:
            losses, metrics = self.surrogate(ratio, log_ratio, logp, adv, mask, ctx, sampler_weights=weights)
        else:
            losses, metrics = self.surrogate(ratio, log_ratio, logp, adv, mask, ctx)
            losses = losses if weights is None else losses * weights
        metrics.update(sampler_metrics)
        keep = self._keep(outputs, batch, logp, old, adv, mask)
        if keep is not None:
            losses = losses * keep
            metrics["kept"] = token_mean(keep, mask, ctx)
        metrics["approx_kl"] = token_mean(0.5 * log_ratio.detach() ** 2, mask, ctx)
        return aggregate(losses, mask, ctx, opts.aggregation), metrics

    def _keep(self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, logp: torch.Tensor,
              old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The product of the entropy and off-policy masks (float ``[B, Lr]``), or None."""
        opts, keep = self.options, None
        if opts.entropy_floor is not None:
            keep = ((outputs["entropy"].detach() * mask) >= opts.entropy_floor) & mask
        if opts.off_policy_threshold is not None:
            reference = old
            if opts.off_policy_logprobs == "sampling":
                if batch.sampling_logprobs is None:
                    raise BatchError(f"loss {self.name!r} with off_policy_logprobs: sampling needs "
                                     "batch.sampling_logprobs")
                reference = batch.sampling_logprobs.float()
            kl = torch.nan_to_num(reference - logp.detach(), nan=0.0) * mask
            mean_kl = kl.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
            on_policy_enough = (adv >= 0) | (mean_kl <= opts.off_policy_threshold)
            keep = on_policy_enough if keep is None else keep & on_policy_enough
        return None if keep is None else keep.to(logp.dtype)


class PPOLoss(PolicyTerm):
    """PPO/GRPO clipped surrogate (clip-higher, dual clip, two-sided clip); level sequence is GSPO.

    Separate low and high clip ranges (DAPO's clip-higher), dual clip (``dual_clip``), and two-sided
    clipping (``delta``: the unclipped ratio capped too)."""

    name = "ppo"
    options_model = PPOOptions

    def surrogate(self, ratio, log_ratio, logp, adv, mask, ctx):
        opts = self.options
        clipped_ratio = ratio.clamp(1.0 - opts.clip_low, 1.0 + opts.high)
        unclipped_ratio = ratio if opts.delta is None else ratio.clamp(max=opts.delta)
        unclipped, clipped = -adv * unclipped_ratio, -adv * clipped_ratio
        losses = torch.maximum(unclipped, clipped)
        dual = torch.zeros_like(mask)
        if getattr(opts, "dual_clip", None) is not None:
            cap = -adv * opts.dual_clip
            dual = (adv < 0) & (losses > cap)
            losses = torch.where(dual, cap, losses)
        # Which side clipped a token: below 1 - clip_low with a negative advantage, above 1 + clip_high
        # with a positive one (TRL's clip_ratio/low_mean and high_mean; the two never overlap).
        low, high = (ratio < 1.0 - opts.clip_low) & (adv < 0), (ratio > 1.0 + opts.high) & (adv > 0)
        metrics = {"clipfrac": token_mean((clipped > unclipped).float(), mask, ctx),
                   "dual_clipfrac": token_mean(dual.float(), mask, ctx)}
        tokens = mask.sum(-1)
        if opts.level == "sequence":  # per sequence, as the ratio is
            metrics["seq_ratio_mean"] = ratio.detach()[:, 0].sum() / ctx.num_sequences
            metrics["clip_low_frac"] = low[:, 0].float().sum() / ctx.num_sequences
            metrics["clip_high_frac"] = high[:, 0].float().sum() / ctx.num_sequences
            seq_low, seq_high = low[:, 0].float(), high[:, 0].float()
        else:
            metrics["clip_low_frac"] = token_mean(low.float(), mask, ctx)
            metrics["clip_high_frac"] = token_mean(high.float(), mask, ctx)
            seq_low, seq_high = ((side & mask).sum(-1) / tokens.clamp(min=1) for side in (low, high))
        # The least and the most clipped sequence (TRL's clip_ratio/low_min and high_max).
        metrics["clip_low_frac_seq_min"] = extreme(seq_low, tokens > 0, largest=False)
        metrics["clip_high_frac_seq_max"] = extreme(seq_high, tokens > 0, largest=True)
        return losses, metrics


class GSPOLoss(PPOLoss):
    """GSPO: one length-normalised importance ratio per sequence, clipped per sequence."""

    name = "gspo"
    options_model = GSPOOptions


class CISPOLoss(PolicyTerm):
    """CISPO: ``-min(ratio, cap).detach() * A * log-prob``; every token keeps a gradient."""

    name = "cispo"
    options_model = CISPOOptions

    def surrogate(self, ratio, log_ratio, logp, adv, mask, ctx):
        opts = self.options
        weight = ratio.clamp(min=opts.ratio_floor, max=opts.ratio_cap).detach()
        capped = (ratio > opts.ratio_cap) & (adv > 0)
        if opts.level == "sequence":  # per sequence, as the ratio is (TRL's cispo_clip_ratio)
            capfrac = capped[:, 0].float().sum() / ctx.num_sequences
        else:
            capfrac = token_mean(capped.float(), mask, ctx)
        return -weight * adv * logp, {"capfrac": capfrac}


class PolicyGradientLoss(PolicyTerm):
    """Plain policy gradient (REINFORCE with advantages): ``-A * log-prob``, no ratio (verl's gpg)."""

    name = "pg"

    def surrogate(self, ratio, log_ratio, logp, adv, mask, ctx):
        return -adv * logp, {}


class SAPOLoss(PolicyTerm):
    """SAPO: a smooth sigmoid gate on the ratio in place of the hard clip.

    ``-sigmoid(t (ratio - 1)) * 4 / t * A``, with the temperature ``t`` chosen by the advantage's sign."""

    name = "sapo"
    options_model = SAPOOptions

    def surrogate(self, ratio, log_ratio, logp, adv, mask, ctx):
        temperature = torch.where(adv > 0, self.options.temperature_pos, self.options.temperature_neg)
        gate = torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature
        return -gate * adv, {}


class VESPOLoss(PolicyTerm):
    """VESPO: -phi(w) * A * log-prob, phi a gamma weight of the sequence's importance ratio.

    ``w`` is the product of the sequence's token ratios (times the sampler weights' with a token-level
    ``sampler_correction``, each clamped to [1e-8, e^20]); ``phi`` is detached and normalised so
    that ``phi(1) = 1``."""

    name = "vespo"
    options_model = VESPOOptions
    folds_sampler_weights = True

    def surrogate(self, ratio, log_ratio, logp, adv, mask, ctx, sampler_weights=None):
        with torch.no_grad():
            opts = self.options
            floor = math.log(1e-8)
            log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
            if sampler_weights is not None:  # log w = log(pi / pi_old) + log(pi_old / pi_sampler)
                log_w = log_w + (torch.log(sampler_weights).clamp(floor, 20.0) * mask).sum(-1, keepdim=True)
            log_w = log_w.clamp(floor, 20.0)
            nonneg = adv >= 0
            k = torch.where(nonneg, opts.k_pos, opts.k_neg)
            lam = torch.where(nonneg, opts.lambda_pos, opts.lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        return -phi * adv * logp, {"phi_mean": phi[:, 0].sum() / ctx.num_sequences}  # one weight per sequence


class DPPOLoss(PolicyTerm):
    """DPPO: ``-A * ratio`` with no clipping, on the tokens whose probability stayed within a trust
    region of the data's policy (DPPO-Binary TV, arXiv 2602.04879; PRIME-RL's default loss).

    The trust region bounds the change of probability ``p - p_old``, not the ratio: a rare token may
    move by a large factor, a likely one only a little. A dropped token still counts in the
    normaliser (it contributes a zero). Pair it with ``{name: kl, against: old}`` for the squared
    log-ratio regulariser the method uses."""

    name = "dppo"
    options_model = DPPOOptions

    def surrogate(self, ratio, log_ratio, logp, adv, mask, ctx):
        opts = self.options
        with torch.no_grad():
            change = torch.exp(logp) - torch.exp(logp - log_ratio)  # p - p_old per token
            rose, fell = change > opts.mask_high, change < -opts.mask_low
            if opts.trust_region == "advantage-sign":
                dropped = torch.where(adv > 0, rose, fell)
            else:
                dropped = rose | fell
            dropped = dropped & mask
        metrics = {"masked": token_mean(dropped.float(), mask, ctx),
                   "masked_high": token_mean((dropped & rose).float(), mask, ctx),
                   "masked_low": token_mean((dropped & fell).float(), mask, ctx)}
        return -adv * ratio * (~dropped).to(ratio.dtype), metrics
