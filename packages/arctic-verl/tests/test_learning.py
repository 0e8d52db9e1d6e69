"""verl's GRPO on Arctic learns: the demo's task as a verl dataset and reward function.

As in the demo, a short SFT warm-up teaches the tiny random policy the answer format (its sampled
reward stays low, about 0.1); verl's own loop then runs GRPO through the Arctic switch and must
raise the mean reward verl logs (``critic/score/mean``) by at least 0.25 (its first five steps
against its last five). The task is the demo's "repeat a digit" part, which GRPO teaches the tiny
policy within a few minutes of CPU time. Sampling is not seeded: over 35 steps most runs gained
0.55-0.65 but one gained 0.27, so the run is longer and the windows wider than a typical run needs;
without learning the gain would be 0 +- 0.05.
"""

from __future__ import annotations

import pytest

from arctic_core.demo.grpo import warmed_up_policy
from arctic_core.demo.task import CountingTask
from verl_run import COUNTING_REWARD, counting_rows, logged_steps, main_ppo_args, run_main_ppo, write_parquet

OPS = ("repeat",)
STEPS = 45
WINDOW = 5


@pytest.mark.timeout(1500)  # verl's own start-up and per-sample agent loop dominate on 2 cores
def test_verl_grpo_on_arctic_raises_the_task_reward(tmp_path):
    policy = warmed_up_policy(tmp_path / "demo", OPS)
    data = write_parquet(counting_rows(CountingTask(ops=OPS)), tmp_path / "task.parquet")
    extra = (f"reward.custom_reward_function.path={COUNTING_REWARD}", "reward.custom_reward_function.name=compute_score",
             "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.clip_grad=1.0",
             "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.use_kl_loss=True",
             "actor_rollout_ref.actor.kl_loss_coef=0.001", "trainer.total_epochs=1000", "trainer.save_freq=-1")
    args = main_ppo_args(policy, data, data, tmp_path, steps=STEPS, batch=8, n=16, response_length=16, extra=extra)
    result = run_main_ppo(args, cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    rewards = [metrics["critic/score/mean"] for _, metrics in sorted(logged_steps(result.stdout + result.stderr).items())]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    print(f"verl GRPO on Arctic: reward {first:.3f} -> {last:.3f} over {STEPS} steps")
    assert last - first >= 0.25, rewards
