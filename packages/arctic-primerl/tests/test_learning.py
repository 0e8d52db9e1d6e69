"""PRIME-RL's protocol through Arctic: a run learns, and the files and routes are PRIME-RL's.

``arctic-primerl``'s service (Arctic embedded, the inference front on a loopback port, the trainer
loop) is driven by a process that behaves as PRIME-RL's orchestrator does on the wire
(``fake_orchestrator.py``): the demo's counting task, GRPO advantages, PRIME-RL's default loss.
As in the demo, a short SFT warm-up first teaches the tiny random policy the answer format.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from transformers import AutoTokenizer

from arctic_core.demo.grpo import warmed_up_policy
from arctic_core.demo.task import CountingTask
from arctic_primerl.config import read_run
from arctic_primerl.service import ArcticPrimeRL
from fake_orchestrator import FakeOrchestrator
from runs import write_toml

STEPS = 24
WINDOW = 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_through_prime_rls_protocol_raises_the_reward(tmp_path):
    policy = warmed_up_policy(tmp_path / "demo", ("repeat",))
    run = read_run(write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", STEPS))
    service = ArcticPrimeRL(run, on_gpu=False)
    url = service.start_front()
    trainer = threading.Thread(target=service.train)
    trainer.start()
    orchestrator = FakeOrchestrator(url, run.run_dir, str(policy), AutoTokenizer.from_pretrained(policy),
                                    CountingTask(ops=("repeat",)), group_size=16, alive=trainer.is_alive,
                                    max_lag=0)  # on-policy steps: the run repeats exactly
    try:
        rewards = asyncio.run(orchestrator.run(STEPS))
        trainer.join(timeout=300)
    finally:
        service.stop()
    assert not trainer.is_alive()
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last - first >= 0.2, rewards
    history = service.trainer.history
    assert len(history) == STEPS and all(h["trainable_tokens"] > 0 for h in history)
    assert history[0]["packed_tokens"] < history[0]["tokens"]  # each prompt packed once per group
    assert all(0.0 < h["entropy/entropy"] < 20.0 for h in history)  # reported per step, as PRIME-RL does
    assert (run.run_dir / "broadcasts" / f"step_{STEPS}" / "STABLE").is_file()
    assert not (run.run_dir / "broadcasts" / "step_0").exists()  # old announcements are cleared
    assert (run.run_dir / "checkpoints" / f"step_{STEPS}" / "arctic" / "arctic_state.json").is_file()
    assert list((run.run_dir / "tensorboard").glob("events.out.tfevents.*"))
