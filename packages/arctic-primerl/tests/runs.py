"""Run folders and services of the arctic-primerl tests."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from arctic_primerl.config import read_run
from arctic_primerl.service import ArcticPrimeRL

FIXTURES = Path(__file__).with_name("fixtures")
"""What PRIME-RL's own code produced (see fixtures/record_fixtures.py)."""

TOML = """
max_steps = {steps}
seq_len = {seq_len}
output_dir = "{output_dir}"

[run]
name = "{run_name}"

[model]
name = "{policy}"

[trainer.optim]
lr = 1e-3
weight_decay = 0.0

[trainer.ckpt]
interval = {steps}

[orchestrator]
group_size = 16
batch_size = 128

[inference.server]
port = 0

[arctic]
group_quiet_ms = 200
{arctic}

[arctic.config]
seed = 0
model = {{device = "cpu"}}
"""


def write_toml(path: Path, policy: Path, run_dir: Path, steps: int = 2, seq_len: int = 256, extra: str = "",
               arctic: str = "") -> Path:
    """A run's rl.toml; ``extra`` tables are appended, ``arctic`` lines go into ``[arctic]``."""
    path.write_text(TOML.format(steps=steps, seq_len=seq_len, output_dir=run_dir.parent, run_name=run_dir.name,
                                policy=policy, arctic=arctic) + extra)
    return path


@contextmanager
def serving(tmp_path: Path, policy: Path, token: str | None = None, **toml):
    """The service of a run (Arctic embedded, the front on a free loopback port); the trainer is
    not started. Yields ``(service, base_url)``."""
    run = read_run(write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", **toml))
    service = ArcticPrimeRL(run, on_gpu=False)
    try:
        yield service, service.start_front(token)
    finally:
        service.stop()
