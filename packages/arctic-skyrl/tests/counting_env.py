"""A two-turn variant of the example's counting environment, and the entry point that registers it.

``counting_twice``: the environment asks for the answer again after the first, and the reward is
the score of the second answer. Each step-wise row of the second turn holds the first turn as its
prompt: the prefix it shares with the first turn's row. ``trainer.override_entrypoint=counting_env``
registers it beside the example's one-turn ``counting`` and hands the run to the adapter.
"""

from __future__ import annotations

import skyrl_gym

from arctic_skyrl import example


class TwoTurnCountingEnv(example.CountingEnv):
    answers = 2


def main() -> None:
    skyrl_gym.register(id="counting_twice", entry_point=TwoTurnCountingEnv)
    example.main()
