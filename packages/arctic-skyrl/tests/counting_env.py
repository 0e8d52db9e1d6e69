"""The demo's counting task as skyrl-gym environments, and the entry point that registers them.

A SkyRL project registers its own environments in its own entry-point module and hands the run to
``arctic_skyrl.entrypoint.main`` from there: ``trainer.override_entrypoint=counting_env``.

* ``counting``: one turn; the reward is the task's score of the answer.
* ``counting_twice``: two turns; the environment asks for the answer again after the first, and
  the reward is the score of the second answer. Each step-wise row of the second turn holds the
  first turn as its prompt: the prefix it shares with the first turn's row.
"""

from __future__ import annotations

from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from arctic_core.demo.task import CountingTask
from arctic_skyrl import entrypoint

TASK = CountingTask()
PROBLEMS = {problem.prompt: problem for problem in TASK.problems()}


class CountingEnv(BaseTextEnv):
    answers = 1  # turns of the episode (BaseTextEnv keeps its own `turns` counter)

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.problem = PROBLEMS[(extras or {})["reward_spec"]["ground_truth"]]
        self.turn = 0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turn += 1
        done = self.turn >= self.answers
        observations = [] if done else [{"role": "user", "content": self.problem.prompt}]
        reward = TASK.reward(self.problem, action) if done else 0.0
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata={})


class TwoTurnCountingEnv(CountingEnv):
    answers = 2


def main() -> None:
    skyrl_gym.register(id="counting", entry_point=CountingEnv)
    skyrl_gym.register(id="counting_twice", entry_point=TwoTurnCountingEnv)
    entrypoint.main()


if __name__ == "__main__":
    main()
