"""SkyRL's GRPO on Arctic learns: the SkyRL guide's "See it learn on the CPU" command, as written.

The command (``python -m arctic_skyrl.example counting``) gives the demo's tiny policy a short SFT
warm-up (it then writes the answer format, with a sampled reward of about 0.1) and runs SkyRL's own
``main_base`` through the Arctic override on the demo's "repeat a digit" task, as a skyrl-gym
environment; the mean reward SkyRL logs (``reward/avg_raw_reward``) must rise by at least 0.25
between the first five and the last five of its 45 steps. Sampling is not seeded: the same task
through verl gained 0.55-0.65 in most runs of 35 steps but 0.27 in one, hence 45 steps and
five-step windows; without learning the gain would be 0 +- 0.05.
"""

from __future__ import annotations

import pytest

from adapter_suites import check_learning_run


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_guides_command_raises_the_reward_through_skyrls_main_base(tmp_path):
    check_learning_run("skyrl.md", "UV_PROJECT_ENVIRONMENT=.venv-skyrl uv run --locked --extra skyrl", "skyrl",
                       tmp_path)
