"""The main job: `arctic-rl demo` learns, logs and saves what it promises."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_reward_rises_and_outputs_are_written(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "arctic_core.cli", "demo", "--out", str(out), "--seed", "0"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"initial_reward", "final_reward", "steps", "seconds"} <= summary.keys()
    assert summary["final_reward"] >= summary["initial_reward"] + 0.3, summary
    # The progress bar with its rate (tqdm writes s/step instead when a step takes over a second).
    assert "GRPO" in proc.stderr and ("step/s" in proc.stderr or "s/step" in proc.stderr)
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoint" / "arctic_state.json").is_file()
    assert (out / "checkpoint" / "hf" / "config.json").is_file()  # the trained policy, loadable by from_pretrained
