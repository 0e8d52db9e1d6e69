"""Configuration: pydantic models with defaults that run, loadable from YAML or Python.

Every model forbids unknown keys, so a typo is an error rather than a silently ignored setting.
Backend-specific settings live in each backend's ``options`` mapping and are validated by that
backend's own model (see e.g. ``arctic_zorro.reference.ReferenceTrainerOptions``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from arctic_core.errors import ConfigError

Dtype = Literal["float32", "bfloat16", "float16"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(StrictModel):
    """Which weights to load: a local Hugging Face folder (``save_pretrained`` layout)."""

    path: str = Field(description="Folder with config.json, weights and tokenizer files.")
    dtype: Dtype = "float32"
    device: str = Field("auto", description="'auto' picks cuda when available, else cpu.")


class OptimizerConfig(StrictModel):
    lr: Annotated[float, Field(gt=0)] = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: Annotated[float, Field(gt=0)] = 1e-8
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    max_grad_norm: Annotated[float, Field(gt=0)] | None = Field(1.0, description="None disables clipping.")


class SchedulerConfig(StrictModel):
    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    total_steps: Annotated[int, Field(gt=0)] | None = Field(None, description="Needed by linear/cosine decay.")
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0

    @model_validator(mode="after")
    def _decay_needs_total(self) -> SchedulerConfig:
        if self.name != "constant" and self.total_steps is None:
            raise ValueError(f"scheduler '{self.name}' decays the LR and needs total_steps")
        return self


class TrainerConfig(StrictModel):
    backend: str = "deepspeed"
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    micro_batch_tokens: Annotated[int, Field(gt=0)] = Field(
        16384, description="Token budget of one micro-batch inside a fwd_bwd or log_probs call."
    )
    gradient_checkpointing: bool = False
    checkpoint_layers: Annotated[int, Field(ge=0)] | None = Field(None, description=(
        "With gradient_checkpointing: checkpoint only the first N decoder layers; the others keep "
        "their activations (less recompute, more memory). None: every layer."))
    options: dict[str, Any] = Field(default_factory=dict, description="Backend-specific settings.")

    @model_validator(mode="after")
    def _layers_need_checkpointing(self) -> TrainerConfig:
        if self.checkpoint_layers is not None and not self.gradient_checkpointing:
            raise ValueError("checkpoint_layers needs gradient_checkpointing: true")
        return self


class LogProbConfig(StrictModel):
    """A forward-only engine, e.g. the frozen reference model for a KL penalty."""

    backend: str = "deepspeed"
    model: ModelConfig | None = Field(None, description="Defaults to the policy's initial weights.")
    micro_batch_tokens: Annotated[int, Field(gt=0)] = 16384
    options: dict[str, Any] = Field(default_factory=dict)


class SamplerConfig(StrictModel):
    backend: str = "embedded"
    max_batch_size: Annotated[int, Field(gt=0)] = 256
    options: dict[str, Any] = Field(default_factory=dict)


class WeightSyncConfig(StrictModel):
    transport: str = "inprocess"
    bucket_bytes: Annotated[int, Field(gt=0)] = 256 * 2**20
    options: dict[str, Any] = Field(default_factory=dict)


class ArcticConfig(StrictModel):
    """Everything a server needs: the policy model and its engines."""

    model: ModelConfig
    trainer: TrainerConfig = TrainerConfig()
    sampler: SamplerConfig = SamplerConfig()
    reference: LogProbConfig | None = Field(None, description="Set to serve reference log-probs (KL).")
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    colocate: bool = Field(False, description=(
        "Engines share one device: before each call the server puts to sleep the engines it does not "
        "need and wakes those it does, so one engine's memory is resident at a time (weight sync wakes both)."))
    seed: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArcticConfig:
        return validate(cls, data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ArcticConfig:
        return load_yaml(cls, path)


class SamplingParams(StrictModel):
    """How to sample; validated before any work starts."""

    n: Annotated[int, Field(ge=1, le=4096)] = 1
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = Field(0, description="0 disables top-k.")
    max_tokens: Annotated[int, Field(ge=1)] = 256
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class LossTermConfig(BaseModel):
    """One loss term by plugin name, with its options (checked by the term itself)."""

    model_config = ConfigDict(extra="allow")
    name: str
    weight: float = 1.0

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def format_validation_error(exc: ValidationError, what: str) -> str:
    lines = [f"invalid {what}:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def validate[M: BaseModel](model: type[M], data: Any, what: str | None = None) -> M:
    """``model.model_validate(data)`` with a readable :class:`ConfigError` on failure."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, what or model.__name__)) from None


def load_yaml[M: BaseModel](model: type[M], path: str | Path) -> M:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    return validate(model, data or {}, f"config {path}")
