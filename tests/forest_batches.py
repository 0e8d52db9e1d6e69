"""Batches that exercise every shape of prefix sharing (used by the ZoRRo tests)."""

from __future__ import annotations

import torch

from arctic_core.batch import RolloutBatch


def forest_batch() -> RolloutBatch:
    """Identical prompts (group of 3), a prompt extending another (multi-turn branch), a response
    shared by two rows, an empty response, ragged lengths, and a singleton group."""
    prompts = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8, 10, 11], [40, 41, 42, 43, 44, 45, 46]]
    responses = [[1, 2, 3], [1, 2, 4, 9, 9, 9, 9], [12], [3, 3], [], [7, 7, 7, 7], [1, 2, 3], [20, 21]]
    index = [0, 0, 0, 1, 1, 2, 0, 3]
    return RolloutBatch.from_lists(prompts, responses, index)


def padded_batch() -> RolloutBatch:
    """The frameworks' padded layout (left-padded prompts, right-padded responses) converted."""
    ids = torch.tensor(
        [[0, 0, 30, 31, 32, 1, 2, 0], [0, 0, 30, 31, 32, 1, 5, 6],
         [33, 34, 35, 36, 37, 9, 0, 0], [0, 0, 30, 31, 32, 4, 0, 0]]
    )
    mask = (torch.arange(8)[None, :] >= torch.tensor([2, 2, 0, 2])[:, None]) & (ids != 0)
    return RolloutBatch.from_padded(ids, mask.long(), prompt_length=5, group_ids=["a", "a", "b", "a"])
