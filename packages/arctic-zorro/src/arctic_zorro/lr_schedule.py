"""Learning-rate schedules from :class:`arctic_core.config.SchedulerConfig` (as LambdaLR factors),
and a framework's per-step override."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from arctic_core.config import SchedulerConfig


def set_lr(optimizer: torch.optim.Optimizer, lr: float | None) -> list[float]:
    """A framework's learning rate for the coming step (None: keep the scheduler's value); returns
    the values it replaced, for ``restore_lr`` when no step is taken. After a step the scheduler
    sets its own value again."""
    previous = [group["lr"] for group in optimizer.param_groups]
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return previous


def restore_lr(optimizer: torch.optim.Optimizer, previous: list[float]) -> None:
    """Undo ``set_lr`` after a step that was skipped or failed: the scheduler did not move, and the
    next step without a framework's rate must run at the scheduler's value, not at this one."""
    for group, lr in zip(optimizer.param_groups, previous, strict=True):
        group["lr"] = lr


def lr_factor(config: SchedulerConfig) -> Callable[[int], float]:
    """Linear warm-up to 1, then constant, linear or cosine decay to ``min_lr_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.name == "constant":
            return 1.0
        assert config.total_steps is not None  # SchedulerConfig guarantees it for decays
        span = max(config.total_steps - config.warmup_steps, 1)
        progress = min((step - config.warmup_steps) / span, 1.0)
        shape = 1.0 - progress if config.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape

    return factor
