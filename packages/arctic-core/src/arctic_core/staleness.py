"""Staleness: how many weight syncs old the policy that drew a token is when it is trained on.

A token drawn by policy version ``v`` and trained while the server serves version ``V`` has
staleness ``V - v``: 0 in a synchronous loop (generate, train, step, sync), ``k`` when rollouts run
``k`` versions ahead of training. ``fwd_bwd(..., max_staleness=K)`` drops (takes out of the loss
mask) every token older than ``K`` versions, each judged by its own version (a sample drawn across
a weight sync keeps its fresher tokens), and reports what it saw and dropped. Nothing else changes:
the importance ratio of the loss terms uses each token's own sampling log-prob, so the tokens kept
are corrected exactly as in a synchronous run; with nothing dropped the batch is trained as given.
"""

from __future__ import annotations

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.errors import RequestError


def token_staleness(batch: RolloutBatch, version: int) -> torch.Tensor:
    """``[B, Lr]`` versions between each token's policy and ``version`` (0 on padding)."""
    if batch.token_policy_version is not None:
        drawn = batch.token_policy_version
    elif batch.policy_version is not None:
        drawn = batch.policy_version[:, None].expand_as(batch.response_ids)
    else:
        raise RequestError("max_staleness needs the batch's policy versions (token_policy_version or "
                           "policy_version, as the sampler returns them)")
    real = batch.response_token_mask()
    newest = int(drawn[real].max()) if real.any() else version
    if newest > version:
        raise RequestError(f"the batch has tokens of policy version {newest}, newer than the server's {version}: "
                           "samples of another server?")
    return (version - drawn).masked_fill(~real, 0)


def drop_stale(batch: RolloutBatch, version: int, max_staleness: int) -> tuple[RolloutBatch, dict[str, float]]:
    """``batch`` without the tokens more than ``max_staleness`` versions old (their loss mask off),
    and metrics: the staleness of the tokens in the loss (mean, max) and what was dropped."""
    staleness = token_staleness(batch, version)
    counted = batch.loss_mask
    stale = counted & (staleness > max_staleness)
    kept = counted & ~stale
    seen = staleness[counted].float()
    metrics = {"staleness_mean": float(seen.mean()) if seen.numel() else 0.0,
               "staleness_max": float(seen.max()) if seen.numel() else 0.0,
               "stale_tokens_dropped": float(stale.sum()),
               "stale_samples_dropped": float((stale.any(1) & ~kept.any(1)).sum())}
    if not stale.any():
        return batch, metrics
    return batch.replace(loss_mask=kept), metrics
