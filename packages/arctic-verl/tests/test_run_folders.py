"""A run in the ``arctic`` mode writes under ``runs/verl/`` of the working folder, not beside a
checkout's sources (verl's ``outputs/``, ``tensorboard_log/``, ``checkpoints/``)."""

from __future__ import annotations

import os

import pytest

from arctic_verl.run_folders import HYDRA_RUN_DIR, hydra_run_dir, main_module, under_runs
from verl_run import gsm8k_rows, main_ppo_args, run_main_ppo, verl_config, write_parquet

MAIN = "verl.trainer.main_ppo"


@pytest.mark.parametrize(("argv", "main", "added"), [
    (["trainer.v1.trainer_mode=arctic"], MAIN, True),
    (["trainer.v1.trainer_mode=arctic", "hydra.run.dir=mine"], MAIN, False),  # the run names its folder
    (["trainer.v1.trainer_mode=arctic", "trainer.v1.trainer_mode=sync"], MAIN, False),  # Hydra's last value: not arctic
    (["data.train_files=x"], MAIN, False),  # plain verl
    (["trainer.v1.trainer_mode=arctic"], "ray._private.workers.default_worker", False),  # verl's workers import it too
])
def test_hydras_run_folder_moves_under_runs_only_for_an_arctic_main_ppo(argv, main, added):
    before = list(argv)
    hydra_run_dir(argv, main, "arctic")
    assert argv == ([*before, f"hydra.run.dir={HYDRA_RUN_DIR}"] if added else before)


@pytest.mark.parametrize(("orig_argv", "main"), [
    (["python", "-m", MAIN, "trainer.v1.trainer_mode=arctic"], MAIN),
    (["python", "-X", "importtime", "-m", MAIN], MAIN),
    (["python", "/site-packages/verl/trainer/main_ppo.py", "x=1"], MAIN),
    (["python", "/site-packages/ray/_private/workers/default_worker.py", "--node-ip-address=1"], None),
    (["python", "-c", "import verl"], None),
])
def test_main_ppo_is_recognised_from_the_interpreters_command_line(orig_argv, main):
    assert main_module(orig_argv) == main


def test_checkpoints_and_tensorboard_logs_default_under_runs(monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    config = verl_config("trainer.project_name=p", "trainer.experiment_name=e")
    under_runs(config)
    assert config.trainer.default_local_dir == "runs/verl/checkpoints/p/e"
    assert os.environ["TENSORBOARD_DIR"] == "runs/verl/tensorboard/p/e"


def test_folders_the_run_names_are_kept(monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", "/mine/tb")
    config = verl_config("trainer.default_local_dir=/mine/ckpt")
    under_runs(config)
    assert config.trainer.default_local_dir == "/mine/ckpt"
    assert os.environ["TENSORBOARD_DIR"] == "/mine/tb"


@pytest.mark.slow
def test_main_ppo_writes_hydras_run_folder_under_runs(policy, tmp_path):
    """A run stopped by the start-up checks (after Hydra made its run folder)."""
    data = write_parquet(gsm8k_rows(2), tmp_path / "data.parquet")
    args = main_ppo_args(policy, data, data, tmp_path, steps=1,
                         extra=("actor_rollout_ref.model.path=/nonexistent/model",))
    result = run_main_ppo(args, cwd=tmp_path, timeout=240)
    assert result.returncode == 2, result.stderr[-4000:]
    assert not (tmp_path / "outputs").exists()
    assert list((tmp_path / "runs" / "verl" / "outputs").glob("*/*/.hydra/config.yaml")), result.stderr[-4000:]
