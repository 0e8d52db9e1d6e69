"""See verl learn on the CPU: GRPO on the demo's counting task through verl's own ``main_ppo``.

    python -m arctic_verl.example counting --out runs/verl-counting

Under ``--out``: the tiny policy after the demo's SFT warm-up (``warmup/``), the task as a verl
dataset (``task.parquet``), verl's output (``run.log``), its TensorBoard logs and Hydra folder, and
``summary.json``. verl runs unmodified, with ``trainer.v1.trainer_mode=arctic`` and the settings
that fit it on a small machine; this module's :func:`compute_score` is its reward function.
"""

from __future__ import annotations

import re
import sys

from arctic_core.demo import frameworks
from arctic_core.demo.frameworks import BATCH, LR, RESPONSE_TOKENS, SAMPLES, Framework, RunPaths
from arctic_core.demo.task import Problem

# The line verl's console logger prints for each step.
STEP_LINE = re.compile(r"step:(?P<step>\d+) - .*\bcritic/score/mean:(?:np\.\w+\()?(?P<reward>[-\d.e]+)")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None, **kwargs) -> float:
    """verl's ``reward.custom_reward_function``: the task's reward of one sample."""
    return frameworks.score(ground_truth, solution_str)


def counting_rows(problems: list[Problem]) -> list[dict]:
    """The task as a verl dataset: the chat prompt, with itself as the ground truth the reward reads."""
    return [{"data_source": "counting", "prompt": [{"role": "user", "content": problem.prompt}],
             "ability": "counting", "reward_model": {"style": "rule", "ground_truth": problem.prompt},
             "extra_info": {"index": index}} for index, problem in enumerate(problems)]


def main_ppo_command(paths: RunPaths, steps: int) -> list[str]:
    """verl's ``main_ppo`` with the Arctic switch: GRPO with verl's KL loss, sized for a CPU."""
    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "trainer.v1.trainer_mode=arctic",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={paths.data}", f"data.val_files={paths.data}",
        f"data.train_batch_size={BATCH}", "data.max_prompt_length=64", f"data.max_response_length={RESPONSE_TOKENS}",
        f"actor_rollout_ref.model.path={paths.policy}",
        f"actor_rollout_ref.rollout.n={SAMPLES}", "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.optim.clip_grad=1.0",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        # verl insists on these micro-batch sizes; Arctic runs the model and ignores them
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        f"reward.custom_reward_function.path={__file__}", "reward.custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1000", "trainer.save_freq=-1",
        "trainer.logger=[console,tensorboard]", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.project_name=arctic", "trainer.experiment_name=counting",
        f"trainer.default_local_dir={paths.out / 'checkpoints'}", f"hydra.run.dir={paths.out / 'outputs'}",
        # verl's defaults for a GPU machine would wait forever for cores a small machine lacks
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "data.dataloader_num_workers=0", "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1", "+ray_kwargs.ray_init.num_cpus=8",
    ]


VERL = Framework(name="verl", outputs=frozenset({"outputs", "tensorboard", "checkpoints"}), rows=counting_rows,
                 command=main_ppo_command, step_line=STEP_LINE)


if __name__ == "__main__":
    frameworks.main(VERL)
