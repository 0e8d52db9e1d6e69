"""The configured optimizer hyperparameters, kept across a checkpoint load.

torch's ``Optimizer.load_state_dict`` and ``LRScheduler.load_state_dict`` restore the values they
were saved with: each parameter group's lr, initial_lr, weight_decay, betas and eps, and the
schedule's base_lrs; DeepSpeed's ZeRO and bf16 optimizers restore their gradient clipping too. A
run resumed with a changed config would train with the checkpoint's values while ``status()``
reports the config's. As in PyTorch Lightning's and Hugging Face Trainer's resumes, the config wins:
a trainer records its hyperparameters as built and puts them back after every load, so that from
the checkpoint come the weights, the optimizer's moments and step counts and the schedule's
position only. With an unchanged config this writes back the values the load restored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

GROUP_KEYS = ("initial_lr", "weight_decay", "betas", "eps")
"""A parameter group's configured hyperparameters; its lr follows from the schedule's position."""


@dataclass(frozen=True)
class Hyperparameters:
    """An optimizer's and its LR schedule's hyperparameters, as the trainer built them."""

    groups: list[dict[str, Any]]
    base_lrs: list[float]
    clip_grad: float | None
    """DeepSpeed's ZeRO and bf16 optimizers' own gradient clipping (None: the optimizer has none)."""

    @classmethod
    def of(cls, optimizer: Any, scheduler: LambdaLR) -> Hyperparameters:
        """``scheduler``'s optimizer holds the groups (DeepSpeed's ``optimizer`` wraps it)."""
        groups = [{key: group[key] for key in GROUP_KEYS} for group in scheduler.optimizer.param_groups]
        return cls(groups, list(scheduler.base_lrs), getattr(optimizer, "clip_grad", None))

    def restore(self, optimizer: Any, scheduler: LambdaLR) -> None:
        """Put them back after a load. The schedule keeps the loaded position (``last_epoch``), and
        each group's lr becomes the configured schedule's there, computed as ``LambdaLR`` does."""
        scheduler.base_lrs = list(self.base_lrs)
        groups = scheduler.optimizer.param_groups
        for group, built, base, factor in zip(groups, self.groups, self.base_lrs, scheduler.lr_lambdas, strict=True):
            group.update(built)
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() answers
        if self.clip_grad is not None:
            optimizer.clip_grad = self.clip_grad
