"""Learning-rate schedules from :class:`arctic_core.config.SchedulerConfig` (as LambdaLR factors),
and a framework's per-step override."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from arctic_core.config import SchedulerConfig


@contextlib.contextmanager
def lr_for_step(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                lr: float | None) -> Iterator[None]:
    """A framework's learning rate for the step taken inside the block (None: keep the scheduler's
    value). A step taken advances the scheduler, which sets its own next value; one skipped or
    failed leaves the scheduler where it was, and its value comes back (the next step without a
    framework's rate runs at the schedule's, not at this one)."""
    previous = [group["lr"] for group in optimizer.param_groups]
    position = scheduler.last_epoch
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    try:
        yield
    finally:
        if scheduler.last_epoch == position:
            for group, value in zip(optimizer.param_groups, previous, strict=True):
                group["lr"] = value


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
