"""``run_ahead``: rollouts run at most ``ahead`` steps ahead of training, beside it; ``ahead=0`` is
the synchronous loop. On the demo's GRPO: at 0 exactly the synchronous run (rewards, metrics and
weights), at 1 every token trained is at most one sync old and none is dropped."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from arctic_core.demo.grpo import DemoSettings, GRPODemo
from arctic_core.run_ahead import run_ahead
from helpers import weights


def recorded(steps: int, ahead: int, train_waits_for_next_rollout: bool = False) -> list[tuple[str, int]]:
    events, lock = [], threading.Lock()
    started = {i: threading.Event() for i in range(steps + ahead + 1)}

    def rollout(step: int) -> int:
        with lock:
            events.append(("rollout", step))
        started[step].set()
        return step * 10

    def train(step: int, value: int) -> int:
        assert value == step * 10
        if train_waits_for_next_rollout and step + 1 < steps:  # proof of overlap: the next rollout runs now
            assert started[step + 1].wait(timeout=5), f"rollout {step + 1} did not start while step {step} trained"
        time.sleep(0.01)
        with lock:
            events.append(("trained", step))
        return step

    assert list(run_ahead(steps, rollout, train, ahead)) == list(range(steps))
    return events


def test_ahead_zero_alternates_as_the_synchronous_loop():
    assert recorded(4, 0) == [(kind, s) for s in range(4) for kind in ("rollout", "trained")]


@pytest.mark.parametrize("ahead", [1, 2])
def test_rollouts_run_beside_training_at_most_ahead_steps_in_front(ahead):
    events = recorded(6, ahead, train_waits_for_next_rollout=True)
    for position, (kind, step) in enumerate(events):
        if kind == "rollout" and step > ahead:  # it starts only once step - ahead - 1 has trained
            assert ("trained", step - ahead - 1) in events[:position], events
    assert [s for kind, s in events if kind == "rollout"] == list(range(6))  # each once, in order


def test_a_failed_rollout_fails_its_step_after_the_steps_before_it():
    trained = []

    def rollout(step: int) -> int:
        if step == 2:
            raise RuntimeError("the environment failed")
        return step

    with pytest.raises(RuntimeError, match="the environment failed"):
        list(run_ahead(5, rollout, lambda step, value: trained.append(step) or step, ahead=1))
    assert trained == [0, 1]


def learned(steps) -> list[dict[str, float]]:
    """Each step's metrics but its timings and memory (rewards, losses, norms, log-prob gaps)."""
    timing = ("seconds", "per_s", "rss")
    return [{k: v for k, v in m.items() if not any(t in k for t in timing)} for m in steps]


def demo(tmp_path, ahead: int) -> GRPODemo:
    settings = DemoSettings(steps=3, warmup_steps=0, prompts_per_step=3, samples_per_prompt=4, ahead=ahead)
    grpo = GRPODemo(tmp_path / f"ahead{ahead}", settings)
    grpo.warm_up()
    return grpo


def test_demo_at_ahead_zero_is_the_synchronous_run_exactly(tmp_path):
    synchronous = demo(tmp_path / "sync", ahead=0)
    expected = [synchronous.grpo_step(step) for step in range(3)]
    looped = demo(tmp_path / "loop", ahead=0)
    assert learned(run_ahead(3, looped.rollout, looped.train, ahead=0)) == learned(expected)
    for name, tensor in weights(synchronous.client).items():
        assert torch.equal(weights(looped.client)[name], tensor), name


def test_demo_one_step_ahead_trains_on_tokens_one_sync_old_and_drops_none(tmp_path):
    grpo = demo(tmp_path, ahead=1)
    metrics = list(run_ahead(3, grpo.rollout, grpo.train, ahead=1))
    assert [m["train/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0]  # steps 1, 2 sampled a sync before
    assert all(m["train/stale_tokens_dropped"] == 0 for m in metrics)
    assert all(0 <= m["reward"] <= 1 for m in metrics)
