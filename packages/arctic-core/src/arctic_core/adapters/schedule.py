"""A framework's learning-rate schedule, run beside Arctic's trainer.

The optimizer lives in the backend, so the framework's schedule cannot step it. The adapter builds
the framework's own scheduler, as the framework would, on a stand-in optimizer of one parameter,
steps it, and passes each step's rate to the backend as ``step(lr=...)``: the rates are the
framework's, step for step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

BuildScheduler = Callable[[torch.optim.Optimizer], LRScheduler]


class StandInSchedule:
    """``schedule(n)``: the learning rate after ``n`` scheduler steps of ``build(optimizer)`` on a
    stand-in optimizer at ``lr`` (the rates are computed once, in step order)."""

    def __init__(self, lr: float, build: BuildScheduler) -> None:
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        self.scheduler = build(self.optimizer)
        self.rates = [self.optimizer.param_groups[0]["lr"]]

    def __call__(self, steps: int) -> float:
        while len(self.rates) <= steps:
            self.optimizer.step()  # (no gradient: a no-op) before the scheduler, as torch expects
            self.scheduler.step()
            self.rates.append(self.optimizer.param_groups[0]["lr"])
        return self.rates[steps]
