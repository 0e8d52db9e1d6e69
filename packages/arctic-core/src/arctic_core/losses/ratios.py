"""Importance ratios, shared by the policy terms and the ratio-weighted KL."""

from __future__ import annotations

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.errors import BatchError


def old_logprobs(batch: RolloutBatch, term: str, logp: torch.Tensor, source: str) -> torch.Tensor:
    """The log-probs of the policy that produced the data: ``batch.old_logprobs``, or with
    ``source == "current"`` (on-policy data) the current ones, detached."""
    if source == "current":
        return logp.detach()
    if batch.old_logprobs is None:
        raise BatchError(f"loss {term!r} needs batch.old_logprobs (log-probs of the policy that sampled the data)")
    return batch.old_logprobs.float()


def at_level(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, gradient: str = "mean") -> torch.Tensor:
    """The log ratio each token carries: its own (``token``), or its sequence's mean over the loss
    mask (``sequence``), whose gradient then reaches every token of the sequence (``gradient:
    mean``) or, with ``gradient: token``, the mean's value with the token's own gradient
    (``sg[mean] + log_ratio - sg[log_ratio]``, verl's GSPO). Summed over a sequence's tokens of
    equal weight the two give the same gradient; they differ once tokens weigh differently."""
    if level == "token":
        return log_ratio
    fmask = mask.to(log_ratio.dtype)
    seq = (log_ratio * fmask).sum(-1, keepdim=True) / fmask.sum(-1, keepdim=True).clamp(min=1)
    if gradient == "token":
        return seq.detach() + log_ratio - log_ratio.detach()
    return seq.expand_as(log_ratio)
