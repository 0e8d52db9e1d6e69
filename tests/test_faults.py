"""Checkpoints under failure. A server process killed with SIGKILL in the middle of save_checkpoint
loses nothing: the previous checkpoint loads whole and trains on, and no partial checkpoint is
ever taken. A save or load that is refused changes nothing: no user file is replaced, no
checkpoint just written is pruned, no trainer is left half-loaded.

The killed server runs in a process of its own (``tests/fault_server.py``) on loopback and kills
itself at a chosen point of its second save; a new server then loads the checkpoint.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from arctic_core.client import ArcticClient
from arctic_core.config import ArcticConfig
from arctic_core.errors import RemoteError, RequestError
from arctic_core.serving.checkpoint_folders import STATE_FILE
from arctic_zorro.torch_backend import STATE_FILE as TRAINER_STATE_FILE
from helpers import PROMPTS, trainer_of, weights

pytestmark = pytest.mark.slow
LOSS = {"name": "ppo", "old_logprobs": "current"}
SERVER = Path(__file__).with_name("fault_server.py")


def start_server(config: ArcticConfig, point: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, str(SERVER), config.model_dump_json(), point],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:  # libraries print banners first; the URL comes once it listens
        if line.startswith("http://127.0.0.1:"):
            return proc, line.strip()
    raise AssertionError(f"the server did not start (exit status {proc.wait()})")


def config_of(tiny_policy: Path, backend: str = "deepspeed", **optimizer: Any) -> ArcticConfig:
    return ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                   "trainer": {"backend": backend, "optimizer": {"lr": 1e-2, **optimizer}}})


def rollout(client: ArcticClient):
    return client.generate(PROMPTS, n=3, max_tokens=6, seed=1).batch.replace(advantages=torch.linspace(-1, 1, 9))


def train_step(client: ArcticClient, batch) -> float:
    loss = client.fwd_bwd(batch, LOSS).metrics["loss"]
    client.step()
    return loss


def files_under(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def assert_untouched(client: ArcticClient, before: dict[str, torch.Tensor], status) -> None:
    """The trainer's weights and the server's counters are what they were before a refused call."""
    now = weights(client)
    assert all(torch.equal(now[name], tensor) for name, tensor in before.items())
    after = client.status()
    assert (after.step, after.policy_version) == (status.step, status.policy_version)


@pytest.mark.parametrize("point", ["trainer-files", "between-renames"])
def test_a_server_killed_mid_save_leaves_the_previous_checkpoint_whole(point, tiny_policy, tmp_path):
    config = config_of(tiny_policy)
    checkpoint = tmp_path / "ckpt"
    proc, url = start_server(config, point)
    try:
        client = ArcticClient.http(url, timeout=120)
        batch = client.generate(PROMPTS, n=3, max_tokens=6, seed=1).batch.replace(
            advantages=torch.linspace(-1, 1, 9))
        train_step(client, batch)
        client.save_checkpoint(str(checkpoint), export_hf=True)
        next_loss = train_step(client, batch)  # what the checkpoint's weights give
        with pytest.raises(RemoteError):  # the server dies inside this save
            client.save_checkpoint(str(checkpoint))
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt."))
    assert leftovers, "the kill should have left a staging or an old folder behind"
    with ArcticClient.in_process(config) as restarted:
        status = restarted.load_checkpoint(str(checkpoint))
        assert status.step == 1  # the first save's state, not anything of the second
        saved = load_file(checkpoint / "hf" / "model.safetensors")
        current = weights(restarted)
        assert all(torch.equal(current[name], tensor) for name, tensor in saved.items())
        assert train_step(restarted, batch) == pytest.approx(next_loss, abs=1e-6)  # trains on
        restarted.save_checkpoint(str(checkpoint))  # a later save clears what the dead one left
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")]
        assert restarted.load_checkpoint(str(checkpoint)).step == 2


def test_save_checkpoint_refuses_a_path_it_would_clobber_and_changes_nothing(tiny_policy, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    (tmp_path / "afile").write_text("mine too")
    (tmp_path / "empty").mkdir()
    before = files_under(tmp_path)
    refused = [("", "does not name a folder"), (".", "does not name a folder"), ("/", "does not name a folder"),
               (f"{tmp_path}/a\0b", "contains a NUL byte"),
               (str(notes), "the folder is not empty and not an Arctic checkpoint"),
               (str(tmp_path / "afile"), "it exists and is not a folder")]
    with ArcticClient.in_process(config_of(tiny_policy)) as client:
        for path, problem in refused:
            with pytest.raises(RequestError, match=problem):
                client.save_checkpoint(path)
        assert files_under(tmp_path) == before  # nothing replaced, nothing left beside
        client.save_checkpoint(str(tmp_path / "empty"))  # an empty folder may take a checkpoint
        assert client.load_checkpoint(str(tmp_path / "empty")).step == 0


def test_a_checkpoint_path_is_the_servers_with_its_home_expanded(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with ArcticClient.in_process(config_of(tiny_policy)) as client:
        client.save_checkpoint("~/checkpoints/start")
        assert (tmp_path / "checkpoints" / "start" / STATE_FILE).is_file() and not (tmp_path / "~").exists()
        assert client.load_checkpoint("~/checkpoints/start").step == 0


def test_keep_last_keeps_the_checkpoint_just_saved_and_leaves_damaged_ones_alone(tiny_policy, tmp_path):
    with ArcticClient.in_process(config_of(tiny_policy)) as client:
        batch = rollout(client)
        for step in range(3):
            client.save_checkpoint(str(tmp_path / f"step-{step}"))
            train_step(client, batch)
        shutil.copytree(tmp_path / "step-0", tmp_path / "damaged")
        (tmp_path / "damaged" / STATE_FILE).write_text("{not json")
        client.load_checkpoint(str(tmp_path / "step-0"))  # back to step 0: the next save has the lowest step
        assert client.save_checkpoint(str(tmp_path / "retry"), keep_last=2).step == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "retry", "step-2"]
        assert client.load_checkpoint(str(tmp_path / "retry")).step == 0


def test_load_checkpoint_refuses_a_damaged_state_file_before_any_engine_loads(tiny_policy, tmp_path):
    damaged = {"not-json": ("{not json", "Invalid JSON"), "no-step": ('{"policy_version": 3}', "step: Field required"),
               "negative": ('{"step": -1, "policy_version": 0}', "step: Input should be greater than or equal to 0")}
    with ArcticClient.in_process(config_of(tiny_policy)) as client:
        batch = rollout(client)
        train_step(client, batch)
        client.save_checkpoint(str(tmp_path / "ckpt"))
        for name, (state, _) in damaged.items():
            shutil.copytree(tmp_path / "ckpt", tmp_path / name)
            (tmp_path / name / STATE_FILE).write_text(state)
        train_step(client, batch)  # the trainer moves away from the checkpoint's weights
        before, status = weights(client), client.status()
        for name, (_, problem) in damaged.items():
            with pytest.raises(RequestError) as info:
                client.load_checkpoint(str(tmp_path / name))
            assert str(tmp_path / name / STATE_FILE) in str(info.value) and problem in str(info.value)
            assert_untouched(client, before, status)


@pytest.mark.parametrize("layout", ["recorded", "missing"])  # missing: saved before checkpoints recorded it
def test_a_checkpoint_of_other_optimizer_groups_is_refused_and_changes_nothing(layout, tiny_policy, tmp_path):
    """The torch trainer (tests/test_deepspeed_engine.py checks the DeepSpeed one)."""
    with ArcticClient.in_process(config_of(tiny_policy, "torch")) as client:  # weight decay 0: one group
        train_step(client, rollout(client))
        client.save_checkpoint(str(tmp_path / "ckpt"))
    if layout == "missing":
        file = tmp_path / "ckpt" / "trainer" / TRAINER_STATE_FILE
        state = torch.load(file, weights_only=True)
        state.pop("layout", None)
        torch.save(state, file)
    grouped = config_of(tiny_policy, "torch", weight_decay=0.1, decay="transformers")  # norms undecayed: two groups
    with ArcticClient.in_process(grouped) as client:
        batch = rollout(client)
        train_step(client, batch)
        trainer = trainer_of(client)
        before, status = weights(client), client.status()
        optimizer = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
        scheduler, steps = trainer.scheduler.state_dict(), trainer.steps
        with pytest.raises(RequestError, match="parameter groups"):
            client.load_checkpoint(str(tmp_path / "ckpt"))
        assert_untouched(client, before, status)
        torch.testing.assert_close(trainer.optimizer.state_dict()["state"][0], optimizer, rtol=0, atol=0)
        assert (trainer.scheduler.state_dict(), trainer.steps) == (scheduler, steps)
        train_step(client, batch)  # trains on
