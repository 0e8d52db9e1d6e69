"""A server process killed with SIGKILL in the middle of save_checkpoint loses nothing: the
previous checkpoint loads whole and trains on, and no partial checkpoint is ever taken.

The server runs in a process of its own (``tests/fault_server.py``) on loopback and kills itself
at a chosen point of its second save; a new server then loads the checkpoint.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from arctic_core.client import ArcticClient
from arctic_core.config import ArcticConfig
from arctic_core.errors import RemoteError
from helpers import PROMPTS, weights

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


def train_step(client: ArcticClient, batch) -> float:
    loss = client.fwd_bwd(batch, LOSS).metrics["loss"]
    client.step()
    return loss


@pytest.mark.parametrize("point", ["trainer-files", "between-renames"])
def test_a_server_killed_mid_save_leaves_the_previous_checkpoint_whole(point, tiny_policy, tmp_path):
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                     "trainer": {"optimizer": {"lr": 1e-2}}})
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
