"""skyrl-gym environments that score the text-to-SQL and long-context QA recipes' SkyRL rows with
each recipe's own reward, and the SkyRL entry module that registers them.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=recipes.skyrl_env \\
        data.train_data="['$HOME/data/bird/train.skyrl.parquet']" <your SkyRL arguments>

Rows written by ``prepare_data --format skyrl`` name their environment in ``env_class``
(``text_to_sql``, ``long_context_qa``); each episode is one answer, scored by the recipe's
``compute_score`` on the row's ``data_source``, ``reward_spec.ground_truth`` and ``extra_info``.
GSM8K's rows name skyrl-gym's own ``gsm8k`` environment, which needs no registration.
Run from the repository root, as the other recipes.
"""

from __future__ import annotations

from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.registration import registry

from recipes.long_context_qa import reward as long_context_qa
from recipes.text_to_sql import reward as text_to_sql

# env_class -> the recipe's verl-style compute_score(data_source, solution_str, ground_truth, extra_info)
SCORERS = {"text_to_sql": text_to_sql.compute_score, "long_context_qa": long_context_qa.compute_score}


class RecipeEnv(BaseTextEnv):
    """One answer per episode, scored by ``compute_score`` on the row's fields."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None, *, compute_score) -> None:
        super().__init__()
        extras = extras or {}
        self.compute_score = compute_score
        self.data_source = extras.get("data_source")
        self.ground_truth = extras["reward_spec"]["ground_truth"]
        self.extra_info = extras.get("extra_info")

    def step(self, action: str) -> BaseTextEnvStepOutput:
        reward = float(self.compute_score(self.data_source, action, self.ground_truth, self.extra_info))
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})


def register() -> None:
    for env_class, compute_score in SCORERS.items():
        if env_class not in registry:  # skyrl-gym refuses a second registration of a name
            skyrl_gym.register(id=env_class, entry_point=RecipeEnv, kwargs={"compute_score": compute_score})


def main() -> None:
    from arctic_skyrl import entrypoint

    register()
    entrypoint.main()


if __name__ == "__main__":
    main()
