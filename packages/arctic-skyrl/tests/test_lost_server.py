"""A server on ``arctic.url`` that goes away mid-run: the run ends on Arctic's line naming it, not
on what SkyRL's generator or trainer failed with next. The server is ``tests/fault_server.py``, an
``arctic-rl serve`` that kills itself (SIGKILL) when the second step's sampling reaches it.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
from pathlib import Path

import pytest

from skyrl_run import gsm8k_rows, logged_scalars, main_base_args, run_main_base, write_parquet

FAULT_SERVER = Path(__file__).parents[3] / "tests" / "fault_server.py"


def start_server(policy: Path, point: str) -> tuple[subprocess.Popen[str], str]:
    spec = importlib.util.spec_from_file_location("fault_server", FAULT_SERVER)
    fault_server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fault_server)
    return fault_server.start_for(policy, point)


@pytest.mark.timeout(900)
def test_a_server_gone_mid_run_is_named_on_the_last_line(policy, tmp_path):
    server, url = start_server(policy, "generate-after-step")
    try:
        data = write_parquet(gsm8k_rows(4), tmp_path / "train.parquet")
        args = main_base_args(policy, data, tmp_path, steps=3,
                              extra=(f"arctic.url={url}", "trainer.algorithm.use_kl_loss=false"))  # no reference served
        result = run_main_base(args, cwd=tmp_path, merged=True)
        gone = server.poll()  # it killed itself before the run ended
    finally:
        server.kill()
    output = result.stdout
    assert gone == -signal.SIGKILL, output[-6000:]
    assert sorted(logged_scalars(tmp_path / "tensorboard")["policy/final_loss"]) == [1], output[-6000:]
    assert result.returncode == 2, output[-6000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"arctic-skyrl: error: the Arctic server at {url} went away (ConnectError"), output[-6000:]
    assert last.endswith("restart it and rerun to resume from the last checkpoint")
    assert output.count("arctic-skyrl: error:") == 1
