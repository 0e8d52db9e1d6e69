"""verl's GRPO on Arctic learns: the verl guide's "See it learn on the CPU" command, as written.

The command (``python -m arctic_verl.example counting``) gives the demo's tiny policy a short SFT
warm-up (it then writes the answer format, with a sampled reward of about 0.1) and runs verl's own
``main_ppo`` through the Arctic switch on the demo's "repeat a digit" task; the mean reward verl
logs (``critic/score/mean``) must rise by at least 0.25 between the first five and the last five
of its 45 steps. Sampling is not seeded: over 35 steps most runs gained 0.55-0.65 but one gained
0.27, hence 45 steps and five-step windows; without learning the gain would be 0 +- 0.05.
"""

from __future__ import annotations

import pytest

from adapter_suites import check_learning_run


@pytest.mark.slow
@pytest.mark.timeout(1500)  # verl's own start-up and per-sample agent loop dominate on 2 cores
def test_the_guides_command_raises_the_reward_through_verls_main_ppo(tmp_path):
    check_learning_run("verl.md", "UV_PROJECT_ENVIRONMENT=.venv-verl uv run --locked --extra verl", "verl", tmp_path)
