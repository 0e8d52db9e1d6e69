"""SkyRL's Ray starts on this environment as it is, and its TensorBoard logs go under runs/."""

from __future__ import annotations

import os
from pathlib import Path

import ray._private.ray_constants as ray_constants

from arctic_skyrl import entrypoint
from arctic_skyrl.settings import ArcticSkyRLConfig


def started_ray(monkeypatch) -> dict:
    """What ``initialize_ray`` finds when the entry point starts Ray (Ray itself not started), as
    under ``uv run`` with Ray's defaults: its uv integration on."""
    monkeypatch.delenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", raising=False)
    monkeypatch.setattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", True)
    seen: dict = {}
    monkeypatch.setattr(entrypoint, "initialize_ray", lambda cfg: seen.update(
        uv_run=ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV, tensorboard=os.environ.get("TENSORBOARD_DIR")))
    entrypoint.start_ray(ArcticSkyRLConfig.from_cli_overrides(["trainer.project_name=p", "trainer.run_name=r"]))
    return seen


def test_workers_do_not_sync_their_own_environment_and_logs_go_under_runs(monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    assert started_ray(monkeypatch) == {"uv_run": False, "tensorboard": str(Path("runs/skyrl/tensorboard/p/r"))}


def test_a_tensorboard_folder_the_run_names_is_kept(monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", "/mine/tb")
    assert started_ray(monkeypatch)["tensorboard"] == "/mine/tb"
