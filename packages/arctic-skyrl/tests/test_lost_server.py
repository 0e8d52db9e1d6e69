"""A server on ``arctic.url`` that goes away mid-run: the run ends on Arctic's line naming it, not
on what SkyRL's generator or trainer failed with next. The server is ``tests/fault_server.py``, an
``arctic-rl serve`` that kills itself (SIGKILL) when the second step's sampling reaches it.
"""

from __future__ import annotations

import pytest

from adapter_suites import check_run_ends_on_lost_server
from skyrl_run import gsm8k_rows, logged_scalars, main_base_args, run_main_base, write_parquet


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_gone_mid_run_is_named_on_the_last_line(policy, tmp_path):
    data = write_parquet(gsm8k_rows(4), tmp_path / "train.parquet")

    def run(url: str):
        args = main_base_args(policy, data, tmp_path, steps=3,
                              extra=(f"arctic.url={url}", "trainer.algorithm.use_kl_loss=false"))  # no reference served
        return run_main_base(args, cwd=tmp_path, merged=True)

    check_run_ends_on_lost_server(policy, "arctic-skyrl", run)
    assert sorted(logged_scalars(tmp_path / "tensorboard")["policy/final_loss"]) == [1]
