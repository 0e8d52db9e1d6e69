"""PRIME-RL's trainer side, served by Arctic: rollout files in, one optimizer step each, STABLE out.

The contract (PRIME-RL's ``trainer/rl/train.py``): steps count from 1; before the first, the
starting weights are announced as ``broadcasts/step_{start-1}``; for step N the trainer waits for
``rollouts/step_N/rank_0.bin``, trains one optimizer step on it and announces the new weights by
writing ``broadcasts/step_N/STABLE``, which the orchestrator's watcher polls for before it asks the
inference server to load them. Arctic's sampler is already serving them by then: the trainer syncs
it in memory (``sync_weights``) before writing STABLE, so no weight files are written.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from arctic_core.client import ArcticClient
from arctic_core.errors import ConfigError
from arctic_core.losses.aggregation import add_metrics
from arctic_core.demo.metrics import MetricsLogger
from arctic_primerl import samples as sample_ops
from arctic_primerl.wire import decode

POLL_S = 0.2


@dataclass
class RunFolder:
    """The run directory PRIME-RL's processes share (its ``output_dir``)."""

    root: Path

    def rollouts(self, step: int, rank: int = 0) -> Path:
        return self.root / "rollouts" / f"step_{step}" / f"rank_{rank}.bin"

    def broadcast(self, step: int) -> Path:
        return self.root / "broadcasts" / f"step_{step}"

    def checkpoint(self, step: int) -> Path:
        return self.root / "checkpoints" / f"step_{step}" / "arctic"

    def steps(self, kind: str) -> dict[int, Path]:
        """The ``kind/step_N`` folders (rollouts, broadcasts, checkpoints) by step."""
        return {int(step): folder for folder in (self.root / kind).glob("step_*")
                if (step := folder.name.removeprefix("step_")).isdigit()}

    def checkpoint_steps(self) -> list[int]:
        """The steps that have an Arctic checkpoint (``checkpoints/step_N/arctic``), in order."""
        return sorted(step for step in self.steps("checkpoints") if self.checkpoint(step).is_dir())

    def prepare(self, resume_step: int | None, clean: bool) -> None:
        """Make the folder safe to start in, as PRIME-RL's launcher does. The trainer would read an
        earlier run's rollout files as this run's: a folder holding an earlier run's steps is refused
        unless this run resumes it (its steps after the resumed one are removed) or ``clean`` is set."""
        earlier = {kind: self.steps(kind) for kind in ("rollouts", "broadcasts", "checkpoints")}
        if resume_step is None and any(earlier.values()) and not clean:
            raise ConfigError(f"{self.root} holds the steps of an earlier run; set clean = true to remove them, "
                              "[resume] to continue that run, or another output_dir / run.name")
        for kind, steps in earlier.items():
            for step, folder in steps.items():
                if resume_step is None or (kind != "checkpoints" and step > resume_step):
                    shutil.rmtree(folder, ignore_errors=True)

    def prune_checkpoints(self, keep: int, keep_interval: int | None = None) -> None:
        """Keep Arctic's ``keep`` newest checkpoints and those of every ``keep_interval``-th step;
        the rest of an older step's folder (the orchestrator's own checkpoint) is PRIME-RL's, and
        the folder goes only once it is empty."""
        for step in self.checkpoint_steps()[:-keep]:
            if keep_interval and step % keep_interval == 0:
                continue
            shutil.rmtree(self.checkpoint(step), ignore_errors=True)
            with contextlib.suppress(OSError):
                self.checkpoint(step).parent.rmdir()

    def announce(self, step: int) -> None:
        """Mark the weights after ``step`` as live (the folder holds no weights: they are in memory)."""
        folder = self.broadcast(step)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "STABLE").touch()
        stale = self.broadcast(step - 2)  # the orchestrator may still read step-1; PRIME-RL keeps two too
        if step >= 2 and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


@dataclass
class TrainerSettings:
    max_steps: int
    loss_terms: list[dict[str, Any]]
    learning_rates: list[float] | None = None
    """The learning rate of each step (PRIME-RL's schedule); None: Arctic's configured schedule."""
    start_step: int = 1
    checkpoints: bool = False
    ckpt_interval: int | None = None
    ckpt_keep_last: int | None = None
    ckpt_keep_interval: int | None = None
    stop: threading.Event = field(default_factory=threading.Event)


class RolloutTrainer:
    """Trains each step's rollout file through an Arctic client (one rank: Arctic spreads the
    batch over its own data-parallel ranks)."""

    def __init__(self, client: ArcticClient, run: RunFolder, settings: TrainerSettings,
                 metrics: MetricsLogger | None = None) -> None:
        self.client, self.run, self.settings, self.metrics = client, run, settings, metrics
        self.history: list[dict[str, float]] = []
        self.announced = settings.start_step - 2  # the last step whose weights the sampler serves
        self.awaited: Path | None = None  # the rollout file the loop waits for (None while it trains)

    def run_steps(self) -> None:
        s = self.settings
        if s.start_step > 1:
            self.client.load_checkpoint(str(self.run.checkpoint(s.start_step - 1)))
        self.client.sync_weights()
        self._announce(s.start_step - 1)
        bar = tqdm(range(s.start_step, s.max_steps + 1), desc="PRIME-RL steps on Arctic", unit="step")
        for step in bar:
            payload = self._wait_for(self.run.rollouts(step))
            if payload is None:
                return  # stopped
            lr = s.learning_rates[step - 1] if s.learning_rates else None
            metrics = self.train_step(payload, f"rollouts/step_{step}/rank_0.bin", lr)
            self._announce(step)
            self._checkpoint(step)
            self.history.append(metrics)
            if self.metrics is not None:
                self.metrics.log("train", metrics, step)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", entropy=f"{metrics.get('entropy/entropy', 0.0):.4f}",
                            samples=int(metrics["samples"]))

    def train_step(self, payload: bytes, source: str, lr: float | None = None) -> dict[str, float]:
        """One optimizer step on one rank's micro-batches; the sampler then serves the new weights."""
        started = time.perf_counter()
        samples = sample_ops.unpack(decode(payload, source))
        count = sample_ops.count_trainable(samples)
        totals: dict[str, float] = {"loss": 0.0}  # a step with no trainable token still steps (a no-op)
        for temperature, batch in sample_ops.by_temperature(samples).items():
            result = self.client.fwd_bwd(batch, self.settings.loss_terms, temperature=temperature, scale=1.0 / count)
            add_call_metrics(totals, result.metrics, float(batch.loss_mask.sum()) / count, count)
        step = self.client.step(lr=lr)
        self.client.sync_weights()
        totals.pop("seconds", None)
        return {**totals, **step.metrics, "samples": float(len(samples)), "trainable_tokens": float(count),
                "seconds": time.perf_counter() - started}

    def _announce(self, step: int) -> None:
        self.announced = step
        self.run.announce(step)

    def _wait_for(self, path: Path) -> bytes | None:
        self.awaited = path
        try:
            while not path.exists():  # the orchestrator renames a finished file into place
                if self.settings.stop.wait(POLL_S):
                    return None
            return path.read_bytes()
        finally:
            self.awaited = None

    def _checkpoint(self, step: int) -> None:
        s = self.settings
        if s.checkpoints and (step == s.max_steps or (s.ckpt_interval and step % s.ckpt_interval == 0)):
            # Each step's checkpoint has a folder of its own (step_N/arctic), so Arctic's keep_last,
            # which prunes a checkpoint's siblings, would find none: prune the step folders here.
            self.client.save_checkpoint(str(self.run.checkpoint(step)))
            if s.ckpt_keep_last:
                self.run.prune_checkpoints(s.ckpt_keep_last, s.ckpt_keep_interval)


def add_call_metrics(totals: dict[str, float], metrics: dict[str, float], share: float, count: int) -> None:
    """Add one fwd_bwd call's metrics into the step's: losses are token sums (divided by the step's
    ``count`` trainable tokens, PRIME-RL's normalisation), token counts add up, and every other
    value is a token mean, weighed by the call's ``share`` of the step's tokens (extremes: the
    step's extreme)."""
    for key, value in metrics.items():
        if key in ("tokens", "packed_tokens"):
            weight = 1.0
        elif key == "loss" or key.endswith("/loss"):
            weight = 1.0 / count
        else:
            weight = share
        add_metrics(totals, {key: value}, weight)
