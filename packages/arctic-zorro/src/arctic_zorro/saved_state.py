"""What the trainers save beside their weights and optimizer state, and the checks a load makes
with it before it changes anything: a checkpoint loads whole into the trainer, or not at all.

The *layout* records what the saved optimizer state only fits: the optimizer's parameter groups
(names and shapes, in order) and, for DeepSpeed, how the state is partitioned. A load compares
it with the trainer's own before touching a weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from arctic_core.config import format_validation_error
from arctic_core.errors import RequestError
from arctic_core.hf import shapes_difference

PARAM_GROUPS = "optimizer parameter groups"
"""The layout's key for :func:`arctic_zorro.param_groups.param_group_shapes`."""


class TrainerState(BaseModel):
    """A trainer's own state in its checkpoint."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    steps: int = Field(ge=0)
    rng: torch.Tensor
    layout: dict[str, Any] | None = None
    """None in checkpoints written before layouts were recorded: the engines' own checks apply."""

    @field_validator("rng")
    @classmethod
    def _rng_state(cls, rng: torch.Tensor) -> torch.Tensor:
        if rng.dtype != torch.uint8:  # torch.set_rng_state would refuse it only after the rest is loaded
            raise ValueError(f"must be a uint8 tensor from torch.get_rng_state(), not {rng.dtype}")
        return rng


class TorchTrainerState(TrainerState):
    """The torch trainer's state file: its optimizer and LR scheduler travel in it."""

    optimizer: dict[str, Any]
    scheduler: dict[str, Any]


def validated[S: TrainerState](model: type[S], data: Any, file: Path) -> S:
    """``data``, read from ``file``, as a ``model``; a RequestError names the file and each problem."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc, f"trainer state in {file}")) from None


def check_layout(saved: dict[str, Any] | None, current: dict[str, Any], path: Path) -> None:
    """Refuse the checkpoint in ``path`` if its optimizer state is laid out for another trainer."""
    if saved is None:
        return
    for key, value in current.items():
        found = saved.get(key)
        if found != value:
            difference = (_groups_difference(found, value) if key == PARAM_GROUPS
                          else f"it was saved with {key} {found}, this trainer has {value}")
            raise RequestError(f"the checkpoint in {path} does not fit this trainer: {difference}; load it into a "
                               "trainer configured as the one that saved it")


def _groups_difference(saved: list[list[Any]] | None, current: list[list[Any]]) -> str:
    saved = saved or []
    params = shapes_difference(_flat(current), _flat(saved))
    if params:
        return f"its optimizer state is for other parameters ({params})"
    sizes = [len(group) for group in saved], [len(group) for group in current]
    if sizes[0] != sizes[1]:
        return (f"its optimizer has parameter groups of {sizes[0]} parameters, this trainer's {sizes[1]} "
                "(trainer.optimizer weight_decay and decay decide the groups)")
    for index, (saved_group, group) in enumerate(zip(saved, current, strict=True)):
        for (saved_name, _), (name, _) in zip(saved_group, group, strict=True):
            if saved_name != name:
                return f"optimizer parameter group {index} holds {saved_name} where this trainer's holds {name}"
    return "its optimizer parameter groups differ"


def _flat(groups: list[list[Any]]) -> dict[str, list[int]]:
    return {name: shape for group in groups for name, shape in group}
