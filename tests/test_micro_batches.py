"""Micro-batch planning and data-parallel balancing keep prompt groups together under a budget."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from arctic_core.batch import RolloutBatch
from arctic_core.config import LossTermConfig
from arctic_core.losses.aggregation import add_metrics
from arctic_core.losses.objective import build_objective
from arctic_core.plugins.interfaces import LossContext
from arctic_core.plugins.registry import default_registry
from arctic_core.ray.trainer import split_by_groups
from arctic_zorro.micro_batches import forest_cost, micro_forward_backward, plan_micro_batches


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



class HostReads(TorchFunctionMode):
    """Appends ``"read"`` to ``events`` at each read of a floating-point tensor's value on the host."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__) and args[0].is_floating_point():
            self.events.append("read")
        return func(*args, **(kwargs or {}))


def test_metrics_are_read_once_after_the_last_backward_is_queued():
    """Reading a value on the host waits for the device: a read between a micro-batch's forward and
    its backward left the device idle there. The summed metrics are read once, after the last
    backward is queued, and equal the sums of each micro-batch's own."""
    batch = grpo_batch([30, 20, 25], n=2, response_len=5)
    weight = torch.tensor(0.01, requires_grad=True)
    objective = build_objective(default_registry(),
                                [LossTermConfig(name="sft"), LossTermConfig(name="entropy", weight=0.1)])
    ctx = LossContext.of(batch)

    def forward(micro: RolloutBatch, processors) -> dict[str, torch.Tensor]:
        values = -weight * micro.response_ids.float()
        return {name: values for name in processors}

    plan = plan_micro_batches(batch, token_budget=60, grouped=True)
    assert len(plan) > 1
    events: list[str] = []
    with HostReads(events):
        metrics = micro_forward_backward(forward, lambda loss: events.append("backward") or loss.backward(), batch,
                                         objective, ctx, 1.0, 60, True, torch.device("cpu"))
    assert events == ["backward"] * len(plan) + ["read"]
    expected: dict[str, float] = {}
    for rows in plan:
        micro = batch.select(rows)
        for key, value in objective(forward(micro, objective.processors), micro, ctx)[1].items():
            expected[key] = expected.get(key, 0.0) + float(value)
    assert list(metrics) == list(expected) == ["sft/loss", "sft/nll", "entropy/loss", "entropy/entropy", "loss"]
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("advantages", [[1.0, -1.0, 1.0, -1.0, -1.0, 1.0], [-1.0] * 6], ids=["mixed", "negative"])
def test_extreme_metrics_are_the_extreme_over_micro_batches_and_the_rest_their_sum(advantages):
    """PPO's least and most clipped sequence (``_min`` / ``_max`` metrics) over micro-batches equal
    the whole batch's in one pass, as the summed metrics do. (Here the micro-batches' most
    high-clipped sequences (mixed) and least low-clipped ones (negative) differ, so their sum would not.)"""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (length,), generator=gen).tolist() for length in (30, 20, 25)]
    responses = [torch.randint(3, 50, (5 + i % 3,), generator=gen).tolist() for i in range(6)]
    batch = RolloutBatch.from_lists(prompts, responses, [i // 2 for i in range(6)])
    batch = batch.replace(advantages=torch.tensor(advantages),
                          old_logprobs=-(torch.randn(batch.response_ids.shape, generator=gen) * 2.0).abs())
    weight = torch.tensor(0.01, requires_grad=True)
    objective = build_objective(default_registry(), [LossTermConfig(name="ppo")])
    ctx = LossContext.of(batch)

    def forward(micro: RolloutBatch, processors) -> dict[str, torch.Tensor]:
        return {"logprobs": -weight * micro.response_ids.float()}

    assert len(plan_micro_batches(batch, token_budget=60, grouped=True)) > 1
    metrics = micro_forward_backward(forward, lambda loss: loss.backward(), batch, objective, ctx, 1.0, 60, True,
                                     torch.device("cpu"))
    whole = {key: float(value) for key, value in objective(forward(batch, objective.processors), batch, ctx)[1].items()}
    assert metrics == pytest.approx(whole, abs=1e-6)


def test_add_metrics_sums_and_keeps_extremes_ignoring_nan():
    totals: dict = {}
    add_metrics(totals, {"a": 1.0, "b_min": float("nan"), "c_max": torch.tensor(0.5)}, weight=2.0)
    add_metrics(totals, {"a": torch.tensor(3.0), "b_min": 0.25, "c_max": torch.tensor(float("nan"))}, weight=2.0)
    add_metrics(totals, {"b_min": 0.75, "c_max": 0.1})
    assert float(totals["a"]) == 8.0 and totals["b_min"] == 0.25 and float(totals["c_max"]) == 0.5
