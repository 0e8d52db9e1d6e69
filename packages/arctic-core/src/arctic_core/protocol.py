"""The client <-> server protocol: one request and one result model per operation.

Every transport (in-process now; HTTP and Ray later) carries exactly these objects, so the server
and client never depend on how bytes move. Tensors live only inside :class:`RolloutBatch` and the
``outputs`` of :class:`LogProbsResult`, which serialise as safetensors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from arctic_core.batch import RolloutBatch
from arctic_core.config import MAX_LR, LossTermConfig, SamplingParams, Temperature, TokenId

EngineName = Literal["trainer", "sampler", "reference"]


class Message(BaseModel):
    # NaN/inf (a skipped step's gradient norm) as the strings "NaN", "Infinity", "-Infinity": strict
    # JSON, which every language's parser reads; validation turns them back into floats.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, ser_json_inf_nan="strings")


class Result(Message):
    metrics: dict[str, float] = Field(default_factory=dict, description="Timings, token counts, losses.")


class GenerateRequest(Message):
    prompts: list[Annotated[list[TokenId], Field(min_length=1)]] = Field(min_length=1)
    params: SamplingParams = SamplingParams()


class GenerateResult(Result):
    batch: RolloutBatch


class LogProbsRequest(Message):
    batch: RolloutBatch
    model: Literal["policy", "reference"] = "policy"
    processors: list[str] = Field(default_factory=lambda: ["logprobs"], min_length=1)
    temperature: Temperature = 1.0


class LogProbsResult(Result):
    outputs: dict[str, torch.Tensor]


class FwdBwdRequest(Message):
    batch: RolloutBatch
    loss: list[LossTermConfig] = Field(min_length=1)
    temperature: Temperature = 1.0
    scale: float = Field(1.0, allow_inf_nan=False,
                         description="Multiplies this call's loss; gradients add up across calls until step().")
    max_response_len: Annotated[int, Field(gt=0)] | None = Field(
        None, description="Constant of Dr.GRPO normalisation; defaults to the batch's response width."
    )
    max_staleness: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Tokens drawn more than this many weight syncs before the server's policy version are "
        "left out of the loss (arctic_core.staleness); None: every token counts."
    )


class Empty(Message):
    """The request of operations that take no arguments."""


class StepRequest(Message):
    lr: Annotated[float, Field(ge=0, le=MAX_LR, allow_inf_nan=False)] | None = Field(
        None, description="Learning rate for this step, for a framework that drives its own schedule "
        "(it then replaces the configured schedule's value; 0, as at a warm-up's first step, still "
        "advances the optimizer's moments)."
    )


class SyncWeightsResult(Result):
    policy_version: int


class CheckpointRequest(Message):
    path: str
    export_hf: bool = Field(False, description="save: also write the policy as a Hugging Face folder at {path}/hf.")
    keep_last: Annotated[int, Field(ge=1)] | None = Field(
        None, description="save: afterwards keep only k Arctic checkpoints beside {path}: this one and the k - 1 "
        "newest others (by step)."
    )


class EnginesRequest(Message):
    engines: list[EngineName] | None = Field(None, description="None means every engine.")


class StatusResult(Result):
    policy_version: int
    step: int
    info: dict[str, Any] = Field(default_factory=dict)


OPS: dict[str, tuple[type[Message], type[Result]]] = {
    "generate": (GenerateRequest, GenerateResult),
    "log_probs": (LogProbsRequest, LogProbsResult),
    "fwd_bwd": (FwdBwdRequest, Result),
    "step": (StepRequest, Result),
    "sync_weights": (Empty, SyncWeightsResult),
    "save_checkpoint": (CheckpointRequest, StatusResult),
    "load_checkpoint": (CheckpointRequest, StatusResult),
    "sleep": (EnginesRequest, Result),
    "wake": (EnginesRequest, Result),
    "status": (Empty, StatusResult),
    "shutdown": (Empty, Result),
}
"""Operation name -> (request model, result model). Transports route by these names."""
