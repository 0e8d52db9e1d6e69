"""PRIME-RL's learning-rate schedules, driven from outside Arctic's trainer.

PRIME-RL steps torch schedulers: constant; linear (warm-up from ``min_lr``, constant, then a
linear decay over the last ``decay_steps``); cosine (warm-up, then cosine annealing to ``min_lr``
at ``max_steps``). The same torch schedulers run here on a one-parameter optimizer, and each step's
value goes to Arctic as ``step(lr=...)``: the learning rates are torch's, step for step.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

from arctic_core.adapters.schedule import StandInSchedule
from arctic_core.config import StrictModel
from arctic_core.errors import ConfigError


class LRSchedule(StrictModel):
    kind: Literal["constant", "linear", "cosine"] = "constant"
    lr: float = Field(gt=0)
    max_steps: int = Field(gt=0)
    warmup_steps: int = Field(0, ge=0)
    decay_steps: int = Field(0, ge=0)
    min_lr: float = Field(0.0, ge=0)

    @classmethod
    def from_prime_rl(cls, table: dict[str, Any], lr: float, max_steps: int) -> LRSchedule:
        """From ``[trainer.scheduler]`` (PRIME-RL's defaults where keys are absent)."""
        table = dict(table)
        kind = table.pop("type", "constant")
        defaults = {"constant": {}, "linear": {"warmup_steps": 10, "decay_steps": 10, "min_lr": 0.0},
                    "cosine": {"warmup_steps": 10, "min_lr": 0.0}}
        if kind not in defaults:
            raise ConfigError(f"trainer.scheduler.type = {kind!r} is unknown; PRIME-RL has {sorted(defaults)}")
        unknown = sorted(set(table) - set(defaults[kind]))
        if unknown:
            raise ConfigError(f"trainer.scheduler: unknown key(s) {unknown} for type {kind!r}")
        return cls(kind=kind, lr=lr, max_steps=max_steps, **{**defaults[kind], **table})

    def rates(self) -> list[float]:
        """The learning rate of steps 1..max_steps (the optimizer steps, then the scheduler)."""
        schedule = StandInSchedule(self.lr, self._scheduler)
        return [schedule(step) for step in range(self.max_steps)]

    def _scheduler(self, optimizer: torch.optim.Optimizer) -> LRScheduler:
        if self.kind == "constant":
            return ConstantLR(optimizer, factor=1.0)
        floor = self.min_lr / self.lr if self.min_lr > 0 else 1e-8
        phases, milestones = [], []
        if self.warmup_steps:
            phases.append(LinearLR(optimizer, start_factor=floor, end_factor=1.0, total_iters=self.warmup_steps))
            milestones.append(self.warmup_steps)
        if self.kind == "cosine":
            phases.append(CosineAnnealingLR(optimizer, T_max=self.max_steps - self.warmup_steps, eta_min=self.min_lr))
        elif self.decay_steps:
            decay_start = self.max_steps - self.decay_steps
            if decay_start < self.warmup_steps:
                raise ConfigError(f"trainer.scheduler: warmup_steps ({self.warmup_steps}) + decay_steps "
                                  f"({self.decay_steps}) exceed max_steps ({self.max_steps})")
            phases.append(LinearLR(optimizer, start_factor=1.0, end_factor=1.0,
                                   total_iters=decay_start - self.warmup_steps))
            phases.append(LinearLR(optimizer, start_factor=1.0, end_factor=floor, total_iters=self.decay_steps - 1))
            milestones.append(decay_start)
        if not phases:
            raise ConfigError("trainer.scheduler: a linear schedule needs warmup_steps or decay_steps")
        return phases[0] if len(phases) == 1 else SequentialLR(optimizer, phases, milestones=milestones)
