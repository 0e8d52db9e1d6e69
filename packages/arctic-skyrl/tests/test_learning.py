"""SkyRL's GRPO on Arctic learns: the demo's task as a skyrl-gym environment.

As in the demo, a short SFT warm-up teaches the tiny random policy the answer format (its sampled
reward stays low, about 0.1); SkyRL's own loop then runs GRPO through the Arctic override and must
raise the mean reward SkyRL logs (``reward/avg_raw_reward``) by at least 0.3 (its first three
steps against its last three). The task is the demo's "repeat a digit" part, which GRPO teaches the
tiny policy within minutes of CPU time (sampling is not seeded: the margin covers run-to-run noise).
"""

from __future__ import annotations

import pytest

from arctic_core.demo.grpo import warmed_up_policy
from arctic_core.demo.task import CountingTask
from skyrl_run import counting_rows, logged_scalars, main_base_args, run_main_base, write_parquet

OPS = ("repeat",)
STEPS = 35
WINDOW = 3


@pytest.mark.timeout(1500)
def test_skyrl_grpo_on_arctic_raises_the_task_reward(tmp_path):
    policy = warmed_up_policy(tmp_path / "demo", OPS)
    data = write_parquet(counting_rows(CountingTask(ops=OPS)), tmp_path / "task.parquet")
    extra = ("trainer.policy.optimizer_config.lr=1e-3", "trainer.algorithm.eps_clip_high=0.28",
             "trainer.epochs=1000", "trainer.ckpt_interval=-1")
    args = main_base_args(policy, data, tmp_path, steps=STEPS, batch=8, n=16, response_length=16,
                          entrypoint="counting_env", extra=extra)
    result = run_main_base(args, cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    rewards = [value for _, value in sorted(logged_scalars(tmp_path / "tensorboard")["reward/avg_raw_reward"].items())]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last - first >= 0.3, rewards
