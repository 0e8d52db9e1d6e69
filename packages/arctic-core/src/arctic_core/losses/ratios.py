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


def at_level(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log ratio each token carries: its own (``token``), or its sequence's mean over the loss
    mask (``sequence``), whose gradient then reaches every token of the sequence."""
    if level == "token":
        return log_ratio
    fmask = mask.to(log_ratio.dtype)
    seq = (log_ratio * fmask).sum(-1, keepdim=True) / fmask.sum(-1, keepdim=True).clamp(min=1)
    return seq.expand_as(log_ratio)
