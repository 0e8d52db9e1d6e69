"""Reducing per-token losses to a scalar, normalised over the whole call (see ``LossContext``).

Modes (``x`` per-token values, ``m`` the loss mask, ``n_i`` loss tokens of response ``i``):

- ``token-mean``: ``sum(x m) / num_tokens``, every token weighs the same (DAPO).
- ``token-sum``: ``sum(x m)``, no normalisation (the loss grows with the batch: verl's ``token-sum``).
- ``seq-mean-token-mean``: ``sum_i (sum_t x m / n_i) / num_sequences`` (GRPO paper, GSPO).
- ``seq-mean-token-sum``: ``sum(x m) / num_sequences``.
- ``seq-mean-token-sum-norm``: ``sum(x m) / (num_sequences * max_response_len)`` (Dr. GRPO: a
  constant normaliser, so long and short answers are not re-weighted by their length).
"""

from __future__ import annotations

from typing import Literal

import torch

from arctic_core.plugins.interfaces import LossContext

Aggregation = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def aggregate(values: torch.Tensor, mask: torch.Tensor, ctx: LossContext, mode: Aggregation) -> torch.Tensor:
    """Sum of ``values`` over ``mask``, normalised as ``mode`` says, over the whole call."""
    masked = values * mask.to(values.dtype)
    if mode == "token-mean":
        return masked.sum() / ctx.num_tokens
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(values.dtype)
        return per_seq.sum() / ctx.num_sequences
    if mode == "seq-mean-token-sum":
        return masked.sum() / ctx.num_sequences
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (ctx.num_sequences * ctx.max_response_len)
    raise ValueError(f"unknown aggregation {mode!r}")


def token_mean(values: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    """A detached token-mean for metrics (additive across micro-batches), left on the device."""
    return aggregate(values.detach(), mask, ctx, "token-mean")
