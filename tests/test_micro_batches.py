"""Micro-batch planning and data-parallel balancing keep prompt groups together under a budget."""

from __future__ import annotations

import pytest

from arctic_core.batch import RolloutBatch
from arctic_core.ray.trainer import split_by_groups
from arctic_zorro.micro_batches import forest_cost, plan_micro_batches


def grpo_batch(prompt_lens: list[int], n: int, response_len: int) -> RolloutBatch:
    prompts = [[p + 1] * length for p, length in enumerate(prompt_lens)]
    responses = [[7] * (response_len + (i % 3)) for _ in prompt_lens for i in range(n)]
    index = [p for p in range(len(prompt_lens)) for _ in range(n)]
    return RolloutBatch.from_lists(prompts, responses, index)


def test_groups_stay_together_and_budgets_hold():
    batch = grpo_batch([100, 80, 60, 40], n=4, response_len=10)
    plans = plan_micro_batches(batch, token_budget=200, grouped=True)
    assert sorted(r for rows in plans for r in rows) == list(range(batch.num_responses))
    groups = batch.groups()
    for rows in plans:
        assert forest_cost(batch, rows) <= 200
        for group in groups:  # a group is either wholly in this micro-batch or not at all
            assert set(group) <= set(rows) or not set(group) & set(rows)


def test_a_group_over_the_budget_is_split_into_chunks_carrying_the_prompt():
    batch = grpo_batch([150], n=8, response_len=20)  # 150 + 8 x ~21 tokens > 250
    plans = plan_micro_batches(batch, token_budget=250, grouped=True)
    assert len(plans) == 2
    assert all(forest_cost(batch, rows) <= 250 for rows in plans)
    assert sorted(r for rows in plans for r in rows) == list(range(8))


def test_a_single_row_over_the_budget_still_runs_alone():
    batch = grpo_batch([500], n=2, response_len=10)
    assert sorted(plan_micro_batches(batch, token_budget=100, grouped=True)) == [[0], [1]]
    assert plan_micro_batches(batch, token_budget=100, grouped=False) == [[0], [1]]


def test_padded_plan_counts_rows_times_longest():
    batch = grpo_batch([10, 10], n=2, response_len=5)  # rows of 15, 16, 15, 16 tokens
    assert plan_micro_batches(batch, token_budget=32) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_get_whole_groups_balanced_by_deduplicated_cost(world):
    batch = grpo_batch([400, 300, 200, 100, 100, 90], n=8, response_len=16)
    shards = [rows or [] for rows in split_by_groups(batch, world)]
    assert sorted(r for rows in shards for r in rows) == list(range(batch.num_responses))
    for group in batch.groups():
        assert sum(bool(set(group) & set(rows)) for rows in shards) == 1
    loads = [forest_cost(batch, rows) for rows in shards]
    largest_group = max(forest_cost(batch, g) for g in batch.groups())
    assert max(loads) - min(loads) <= largest_group  # LPT: imbalance below one group
