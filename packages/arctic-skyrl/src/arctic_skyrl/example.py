"""See SkyRL learn on the CPU: GRPO on the demo's counting task through SkyRL's own ``main_base``.

    python -m arctic_skyrl.example counting --out runs/skyrl-counting

Under ``--out``: the tiny policy after the demo's SFT warm-up (``warmup/``), the task as SkyRL
prompts (``task.parquet``), SkyRL's output (``run.log``), its TensorBoard logs and
``summary.json``. SkyRL runs unmodified; its ``trainer.override_entrypoint`` names this module,
whose :func:`main` registers the task's skyrl-gym environment and hands the run to the adapter, as
a project with its own environments does.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from arctic_core.demo import frameworks
from arctic_core.demo.frameworks import BATCH, LR, RESPONSE_TOKENS, SAMPLES, Framework, RunPaths
from arctic_core.demo.task import Problem

ENTRY = "arctic_skyrl.example"  # this module, as SkyRL's trainer.override_entrypoint names it
ENV = "counting"
REWARD_LINE = re.compile(r"reward/avg_raw_reward: (?P<reward>[-+\d.eE]+)")


class CountingEnv(BaseTextEnv):
    """The reward is the task's score of the episode's last answer; with ``answers`` > 1 the prompt
    is asked again after each answer but the last."""

    answers = 1

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.prompt = (extras or {})["reward_spec"]["ground_truth"]
        self.turn = 0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turn += 1
        done = self.turn >= self.answers
        observations = [] if done else [{"role": "user", "content": self.prompt}]
        reward = frameworks.score(self.prompt, action) if done else 0.0
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata={})


def main() -> None:
    """SkyRL's entry (``trainer.override_entrypoint=arctic_skyrl.example``): register the task's
    environment, then run as ``arctic_skyrl.entrypoint`` does."""
    from arctic_skyrl import entrypoint  # SkyRL's trainer: not needed by the command that starts it

    skyrl_gym.register(id=ENV, entry_point=CountingEnv)
    entrypoint.main()


def counting_rows(problems: list[Problem], env_class: str = ENV) -> list[dict]:
    """The task as SkyRL prompts, each with itself as the ground truth the environment reads."""
    return [{"data_source": "counting", "prompt": [{"role": "user", "content": problem.prompt}],
             "env_class": env_class, "reward_spec": {"method": "rule", "ground_truth": problem.prompt},
             "extra_info": {"index": index}} for index, problem in enumerate(problems)]


def main_base_command(paths: RunPaths, steps: int) -> list[str]:
    """SkyRL's ``main_base`` with this module as its entry point: GRPO, sized for a CPU."""
    return [
        sys.executable, "-m", "skyrl.train.entrypoints.main_base",
        f"trainer.override_entrypoint={ENTRY}",
        f"data.train_data=['{paths.data}']",
        f"trainer.policy.model.path={paths.policy}",
        "trainer.algorithm.advantage_estimator=grpo",
        f"trainer.train_batch_size={BATCH}", f"trainer.policy_mini_batch_size={BATCH}",
        f"generator.n_samples_per_prompt={SAMPLES}", f"generator.sampling_params.max_generate_length={RESPONSE_TOKENS}",
        "trainer.max_prompt_length=512",
        f"trainer.policy.optimizer_config.lr={LR}", "trainer.algorithm.eps_clip_high=0.28",
        f"trainer.max_training_steps={steps}", "trainer.epochs=1000", "trainer.ckpt_interval=-1",
        "trainer.eval_interval=-1", "trainer.eval_before_train=false",
        f"trainer.ckpt_path={paths.out / 'ckpts'}", f"trainer.export_path={paths.out / 'exports'}",
        f"trainer.log_path={paths.out / 'logs'}", "trainer.logger=tensorboard", "trainer.run_name=counting",
        # SkyRL's defaults for a GPU machine: 8 loader processes and a GPU monitor
        "data.dataloader.num_workers=0", "trainer.enable_ray_gpu_monitor=false",
    ]


SKYRL = Framework(name="skyrl", outputs=frozenset({"tensorboard", "ckpts", "exports", "logs"}), rows=counting_rows,
                  command=main_base_command, step_line=REWARD_LINE)  # SkyRL logs the steps' rewards in order


if __name__ == "__main__":
    frameworks.main(SKYRL)
