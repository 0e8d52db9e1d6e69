"""``bench/multi_gpu.py --smoke``: the several-GPU benchmark's own code (ranks against one rank, a
sampler replica synced by ``torch-broadcast``, a killed rank's recovery) runs end to end on the
CPU, with Ray ranks on gloo, and reports what the GPU run will be read by."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--smoke"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ranks_give_one_ranks_update(report):
    for stage in ("zero2", "zero3"):
        training = report["training"][stage]
        assert training["workers"] == report["gpus"] == 2
        assert training["loss_gap"] < 1e-6
        # in units of the fp32 spacing at each weight (+ 1e-4 of its tensor's largest update)
        assert training["weights"]["within_tolerance"] < 2
        assert report["speed"][stage]["loss_gap"] < 1e-6


def test_prompt_groups_are_split_across_ranks(report):
    speed = report["speed"]
    per_rank = speed["packed_tokens_per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == speed["global_batch"]["packed_tokens"]
    assert max(per_rank) <= 0.6 * sum(per_rank)  # balanced by deduplicated tokens, group by group


def test_sync_brings_the_sampler_to_the_trainer(report):
    steps = report["grpo"]["steps"]
    assert [s["version"] for s in steps] == list(range(len(steps)))
    for step in steps:
        assert step["sync_bytes"] > 0
        # the sampler's log-probs of its tokens equal the trainer's after a sync, not after a step alone
        assert step["gap_synced"] < 1e-5 < step["gap_after_step_before_sync"]


def test_a_killed_rank_is_named_and_training_resumes(report):
    recovery = report["recovery"]
    assert "rank 1 died during fwd_bwd" in recovery["error"]
    assert recovery["loss_after_restore"] == recovery["expected_loss"]
    assert recovery["grad_norm_after"] > 0
