"""A server on ``+arctic.url`` that goes away mid-run: the run ends on Arctic's line naming it.

verl's own failure comes after the server's (an agent-loop worker's failed ``generate`` leaves its
replay buffer with nothing to train on, and verl says so): without the adapter the run's last line
would send the user to verl's sampler settings. The server here is ``tests/fault_server.py``, an
``arctic-rl serve`` that kills itself (SIGKILL) when the second step's sampling reaches it.
"""

from __future__ import annotations

import pytest

from adapter_suites import check_run_ends_on_lost_server
from verl_run import gsm8k_rows, logged_steps, main_ppo_args, run_main_ppo, write_parquet


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_gone_mid_run_is_named_on_the_last_line(policy, tmp_path):
    data = write_parquet(gsm8k_rows(4), tmp_path / "data.parquet")

    def run(url: str):
        args = main_ppo_args(policy, data, data, tmp_path, steps=3, extra=(f"+arctic.url={url}",))
        return run_main_ppo(args, cwd=tmp_path, merged=True)

    result = check_run_ends_on_lost_server(policy, "arctic-verl", run)
    assert sorted(logged_steps(result.stdout)) == [1], result.stdout[-6000:]  # step 1 trained; step 2's sampling failed
