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

import math
from collections.abc import Mapping
from typing import Literal

import torch

from arctic_core.plugins.interfaces import LossContext, Metrics

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


def extreme(values: torch.Tensor, where: torch.Tensor, largest: bool) -> torch.Tensor:
    """The smallest (``largest``: the largest) of ``values`` where ``where`` is true (same shape),
    detached and on the device (no host sync); NaN where nothing is."""
    if values.numel() == 0:
        return values.new_full((), math.nan)
    fill = -math.inf if largest else math.inf
    kept = torch.where(where, values.detach(), fill)
    value = kept.max() if largest else kept.min()
    return torch.where(where.any(), value, math.nan)


def add_metrics(totals: Metrics, part: Mapping[str, float | torch.Tensor], weight: float = 1.0) -> None:
    """Add one part's metrics (a micro-batch's, a rank's) into ``totals``: each times ``weight``
    and summed, except extremes (names ending in ``_min`` / ``_max``): the smallest / largest
    seen, NaN ignored. Device tensors stay on the device."""
    for key, value in part.items():
        if key.endswith(("_min", "_max")):
            totals[key] = value if key not in totals else _extreme(totals[key], value, key.endswith("_max"))
        else:
            totals[key] = totals.get(key, 0.0) + weight * value


def _extreme(a: float | torch.Tensor, b: float | torch.Tensor, largest: bool) -> float | torch.Tensor:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return torch.fmax(a, b) if largest else torch.fmin(a, b)
    if math.isnan(a) or math.isnan(b):
        return b if math.isnan(a) else a
    return max(a, b) if largest else min(a, b)
