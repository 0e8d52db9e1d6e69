"""Splitting a call's batch into micro-batches under a token budget, and stitching outputs back."""

from __future__ import annotations

import torch

from arctic_core.batch import RolloutBatch


def plan_micro_batches(batch: RolloutBatch, token_budget: int) -> list[list[int]]:
    """Consecutive row ranges whose padded cost (rows x longest sequence) fits ``token_budget``.

    A row longer than the budget still gets a micro-batch of its own: correctness over the budget.
    """
    lengths = (batch.prompt_lens[batch.prompt_index] + batch.response_lens).tolist()
    plans: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row, length in enumerate(lengths):
        wider = max(longest, length)
        if current and wider * (len(current) + 1) > token_budget:
            plans.append(current)
            current, wider = [], length
        current.append(row)
        longest = wider
    if current:
        plans.append(current)
    return plans


def assemble_outputs(
    batch: RolloutBatch, parts: list[tuple[list[int], dict[str, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """Stitch micro-batch outputs back into ``[B, Lr]`` tensors in the batch's row order."""
    out: dict[str, torch.Tensor] = {}
    for rows, outputs in parts:
        for name, values in outputs.items():
            full = out.setdefault(name, torch.zeros(tuple(batch.response_ids.shape), dtype=values.dtype))
            full[rows, : values.shape[1]] = values.cpu()
    return out
