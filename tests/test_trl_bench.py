"""``bench/trl_step.py``: the TRL GRPO step on Arctic and its baseline, TRL's own GRPOTrainer, run
from one script with the same model, prompts, reward and settings. On the CPU (``--smoke``) both
sides run end to end, so the baseline's harness is the one the GPU figures come from (there TRL
samples with vLLM in colocate mode; here with transformers, as vLLM does not run on this CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def run_bench(*flags: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "trl_step.py"), "--smoke", *flags],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_baseline_and_arctic_run_the_same_step_from_one_script():
    ours, baseline = run_bench(), run_bench("--baseline")
    assert ours["system"].endswith("on arctic") and ours["sampler"] == "embedded"
    assert not baseline["system"].endswith("on arctic") and baseline["sampler"] == "transformers generate"
    shape = ("prompts", "n", "prompt_len", "max_new")
    assert [ours[k] for k in shape] == [baseline[k] for k in shape] == [8, 8, 64, 16]
    for report in (ours, baseline):
        assert len(report["steps"]) == 2 and all(seconds > 0 for seconds in report["steps"])
        low, high = report["step_s_steady_range"]
        assert low <= report["step_s_steady_median"] <= high
