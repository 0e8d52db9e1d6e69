"""Same seed, same bits: on the CPU the demo repeats itself exactly, and a resumed run equals an
uninterrupted one bit for bit (weights, samples, log-probs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from arctic_core.client import ArcticClient
from helpers import PROMPTS, weights

pytestmark = pytest.mark.slow
LOSS = [{"name": "ppo", "clip_low": 0.2, "clip_high": 0.28}, {"name": "kl", "weight": 0.01}]


def grpo_steps(client: ArcticClient, steps: range) -> list[torch.Tensor]:
    """The demo's GRPO step with a seed per step; returns each step's samples."""
    samples = []
    for step in steps:
        batch = client.generate(PROMPTS * 2, n=4, max_tokens=8, seed=1000 + step).batch
        rewards = (batch.response_ids % 3 == 0).float().sum(1) / batch.response_lens.clamp(min=1)
        advantages = torch.zeros_like(rewards)
        for rows in batch.groups():
            advantages[rows] = rewards[rows] - rewards[rows].mean()
        old = client.log_probs(batch).outputs["logprobs"]
        ref = client.log_probs(batch, model="reference").outputs["logprobs"]
        client.fwd_bwd(batch.replace(old_logprobs=old, ref_logprobs=ref, advantages=advantages), LOSS)
        client.step()
        client.sync_weights()
        samples.append(batch.response_ids)
    return samples


def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(arctic_config, tmp_path):
    config = arctic_config(trainer={"optimizer": {"lr": 1e-2}, "micro_batch_tokens": 64,
                                    "scheduler": {"name": "cosine", "warmup_steps": 1, "total_steps": 6}},
                           reference={})
    with ArcticClient.in_process(config) as client:
        straight = grpo_steps(client, range(6))
        expected = weights(client)
    with ArcticClient.in_process(config) as first:
        resumed = grpo_steps(first, range(3))
        first.save_checkpoint(str(tmp_path / "half"))
    with ArcticClient.in_process(config) as second:
        second.load_checkpoint(str(tmp_path / "half"))
        resumed += grpo_steps(second, range(3, 6))
        got = weights(second)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    assert all(torch.equal(expected[name], got[name]) for name in expected), \
        [name for name in expected if not torch.equal(expected[name], got[name])]


def test_two_demo_runs_with_one_seed_end_with_identical_weights(tmp_path):
    for run in ("a", "b"):
        proc = subprocess.run([sys.executable, "-m", "arctic_core.cli", "demo", "--out", str(tmp_path / run),
                               "--steps", "3", "--warmup-steps", "2", "--seed", "4"],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (load_file(tmp_path / run / "checkpoint" / "hf" / "model.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
