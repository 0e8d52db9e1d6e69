"""Every benchmark in ``bench/`` with a ``--smoke`` mode runs it on the CPU: its own code (and the
exactness check the mode makes) runs end to end, so a GPU run does not fail on a renamed import.
Triton kernels run under ``TRITON_INTERPRET=1``.

Not here: ``trl_step.py`` (``tests/test_trl_bench.py``) and ``multi_gpu.py``
(``tests/test_multi_gpu_bench.py``) have tests that assert on what they report; ``ray_one_gpu.py``
takes minutes on two cores, and ``multi_gpu.py --smoke`` runs its parts (training ranks, GRPO
steps with a sampler replica, a killed rank's recovery); ``verl_step.py`` and ``skyrl_step.py`` need the verl
and SkyRL environments (``--extra verl``, ``--extra skyrl``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRITON = {"TRITON_INTERPRET": "1"}
SLOW = pytest.mark.slow

# slow: more than a few seconds on two CPU cores (the pyproject's marker).
CASES = [
    pytest.param("fca_kernels.py", {}, id="fca_kernels", marks=SLOW),
    pytest.param("token_stats.py", TRITON, id="token_stats"),
    pytest.param("trainer_step.py", {}, id="trainer_step", marks=SLOW),
    pytest.param("sampler.py", {}, id="sampler", marks=SLOW),
    pytest.param("zorro_train.py", {}, id="zorro_train", marks=SLOW),
    pytest.param("weight_sync.py", {}, id="weight_sync", marks=SLOW),
    pytest.param("decode_gemm.py", TRITON, id="decode_gemm", marks=SLOW),
    pytest.param("sampling_kernels.py", TRITON, id="sampling_kernels", marks=SLOW),
    pytest.param("multi_turn.py", {}, id="multi_turn", marks=SLOW),
]


@pytest.mark.parametrize(("script", "env"), CASES)
def test_the_bench_script_runs_its_smoke_mode(script, env, tmp_path):
    path = os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path, **env}, cwd=tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    json.loads(proc.stdout.strip().splitlines()[-1])  # each ends on a JSON line of what it measured
