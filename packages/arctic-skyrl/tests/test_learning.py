"""SkyRL's GRPO on Arctic learns: the demo's task as a skyrl-gym environment.

As in the demo, a short SFT warm-up teaches the tiny random policy the answer format (its sampled
reward stays low, about 0.1); SkyRL's own loop then runs GRPO through the Arctic override and must
raise the mean reward SkyRL logs (``reward/avg_raw_reward``) by at least 0.25 (its first five
steps against its last five). The task is the demo's "repeat a digit" part, which GRPO teaches the
tiny policy within minutes of CPU time. Sampling is not seeded: the same task through verl gained
0.55-0.65 in most runs of 35 steps but 0.27 in one, so the run is longer and the windows wider than
a typical run needs; without learning the gain would be 0 +- 0.05.
"""

from __future__ import annotations

import pytest

from arctic_core.demo.grpo import warmed_up_policy
from arctic_core.demo.task import CountingTask
from skyrl_run import counting_rows, logged_scalars, main_base_args, run_main_base, write_parquet

OPS = ("repeat",)
STEPS = 45
WINDOW = 5


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
    print(f"SkyRL GRPO on Arctic: reward {first:.3f} -> {last:.3f} over {STEPS} steps")
    assert last - first >= 0.25, rewards
