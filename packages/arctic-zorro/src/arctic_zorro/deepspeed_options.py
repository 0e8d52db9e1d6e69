"""The DeepSpeed backends' ``options``, apart from the engines so that a config is checked
without importing DeepSpeed (importing it picks an accelerator and sets the launcher's variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from arctic_core.config import StrictModel
from arctic_zorro.packed_forward import ZorroOptions


class DeepSpeedLogProbOptions(StrictModel):
    """``options`` of the DeepSpeed log-prob engine. The precision follows ``model.dtype``."""

    zero_stage: Literal[0, 1, 2, 3] = 3
    """Only stage 3 changes a forward-only engine (partitioned weights); 0-2 keep full weights."""
    offload_param: bool = False
    """ZeRO-3 only: keep the partitioned weights in CPU memory."""
    zorro: ZorroOptions = ZorroOptions()
    """Prompt-deduplicated packed forward (on by default)."""

    @model_validator(mode="after")
    def _offload_param_needs_stage_3(self) -> DeepSpeedLogProbOptions:
        if self.offload_param and self.zero_stage != 3:
            raise ValueError("offload_param needs zero_stage 3")
        return self


class DeepSpeedTrainerOptions(DeepSpeedLogProbOptions):
    """``options`` of the DeepSpeed trainer."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """Partitioned over ranks: 1 optimizer states, 2 and gradients, 3 and weights (0: none).
    With bfloat16, stage 1 runs DeepSpeed's bf16 optimizer: on one GPU each step ends sooner, but
    the trainer cannot sleep (so not with ``colocate``)."""
    offload_optimizer: bool = False
    """ZeRO 1-3: keep the fp32 master weights and Adam states in CPU memory (step on the CPU)."""

    @model_validator(mode="after")
    def _offload_optimizer_needs_zero(self) -> DeepSpeedTrainerOptions:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3")
        return self
