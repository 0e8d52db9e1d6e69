"""Configuration: pydantic models with defaults that run, loadable from YAML or Python.

Every model forbids unknown keys, so a typo is an error rather than a silently ignored setting.
Backend-specific settings live in each backend's ``options`` mapping and are validated by that
backend's own model (see e.g. ``arctic_zorro.torch_backend.TorchOptions``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from arctic_core.errors import ConfigError
from arctic_core.model_folders import model_folder

Dtype = Literal["float32", "bfloat16", "float16"]
# Strict: a bool, a float or a numeric string is a caller's bug, not a token id (lax ints would take
# True as 1, "2" and 2.0 as 2).
TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**63)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]  # torch's generators take 64-bit seeds
AdamBeta = Annotated[float, Field(ge=0, lt=1)]


class StrictModel(BaseModel):
    # Unknown keys are errors; a docstring under a field is its description (the config reference shows it).
    # No setting is NaN or infinite (a NaN threshold would silently mask every token or poison the
    # gradients already accumulated): "no bound" is None. Plugins' options models inherit this.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


class ModelConfig(StrictModel):
    """Which weights to load: a local Hugging Face folder (``save_pretrained`` layout) or a Hub model."""

    path: str = Field(description=(
        "Folder with config.json, weights and tokenizer files, or a model id on the Hugging Face Hub "
        "(e.g. Qwen/Qwen3-1.7B), fetched once into the Hub's cache at start."))
    dtype: Dtype = Field("float32", description="Precision of the weights the engines hold (bfloat16 on GPUs).")
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
                        description="'auto' picks cuda when available, else cpu; or cpu, cuda, cuda:N, mps.")

    def local(self, where: str = "model") -> ModelConfig:
        """This model with ``path`` a local folder (a Hub model fetched; see :mod:`arctic_core.model_folders`);
        anything else refused naming the setting ``where``, before any engine starts."""
        return self.model_copy(update={"path": model_folder(self.path, f"{where}.path")})


# AdamW moves each weight by up to about lr per step: a larger rate is a typo, and one far larger
# overflows the optimizer's fp32 arithmetic after it has already advanced its moments.
MAX_LR = 1.0


class OptimizerConfig(StrictModel):
    """AdamW (torch's, in every training backend) and gradient clipping."""

    lr: Annotated[float, Field(gt=0, le=MAX_LR)] = Field(1e-5,
                                                         description="Peak learning rate (the schedule scales it).")
    betas: tuple[AdamBeta, AdamBeta] = Field((0.9, 0.999), description="Adam's moment decays, each in [0, 1).")
    eps: Annotated[float, Field(gt=0)] = Field(1e-8, description="Adam's denominator term.")
    weight_decay: Annotated[float, Field(ge=0)] = Field(0.0, description="Decoupled (AdamW) weight decay.")
    decay: Literal["all", "transformers"] = Field("all", description=(
        "Which parameters weight decay applies to: all, or those Hugging Face's Trainer decays (not biases, "
        "not normalisation weights)."))
    max_grad_norm: Annotated[float, Field(gt=0)] | None = Field(
        1.0, description="Clip the global gradient norm to this before each step; None disables clipping.")


class SchedulerConfig(StrictModel):
    """The learning-rate schedule, advanced once per optimizer step (a ``step(lr=...)`` overrides it)."""

    name: Literal["constant", "linear", "cosine"] = Field("constant", description="Shape after the warm-up.")
    warmup_steps: Annotated[int, Field(ge=0)] = Field(0, description="Steps of linear warm-up from lr/warmup_steps.")
    total_steps: Annotated[int, Field(gt=0)] | None = Field(None, description="Needed by linear/cosine decay.")
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = Field(0.0, description="Where decay ends, as a share of lr.")

    @model_validator(mode="after")
    def _decay_needs_total(self) -> SchedulerConfig:
        if self.name != "constant" and self.total_steps is None:
            raise ValueError(f"scheduler '{self.name}' decays the LR and needs total_steps")
        return self


class EngineSection(StrictModel):
    """A config section that selects a backend by name and passes it ``options``."""

    SECTION: ClassVar[str]
    """Where the section sits in :class:`ArcticConfig` (for error messages)."""
    backend: str
    options: dict[str, Any]


class TrainerConfig(EngineSection):
    SECTION = "trainer"
    backend: str = Field("deepspeed", description=(
        "Training backend, by plugin name: deepspeed or torch (both from the arctic-zorro package), "
        "ray (data-parallel Ray ranks of another backend)."))
    optimizer: OptimizerConfig = Field(OptimizerConfig(), description="AdamW and gradient clipping.")
    scheduler: SchedulerConfig = Field(SchedulerConfig(), description="The learning-rate schedule.")
    micro_batch_tokens: Annotated[int, Field(gt=0)] = Field(
        16384, description="Token budget of one micro-batch inside a fwd_bwd or log_probs call."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    checkpoint_layers: Annotated[int, Field(ge=0)] | Literal["auto"] | None = Field(None, description=(
        "With gradient_checkpointing: checkpoint only the first N decoder layers; the others keep "
        "their activations (less recompute, more memory). None: every layer. auto: before each "
        "micro-batch, as few as the free GPU memory allows (every layer on the CPU)."))
    compile_elementwise: bool | Literal["auto"] = Field("auto", description=(
        "Run the decoder layers' RMSNorms, SiLU x up and rotary embedding (Qwen3, Qwen2, Llama, Mistral) "
        "as fused kernels (torch.compile; the rotary embedding a Triton kernel on a GPU in half precision): "
        "the same expressions, fewer kernels; the first calls compile. auto: on for those families on a "
        "CUDA device; true: on, refusing other models."))
    options: dict[str, Any] = Field(default_factory=dict, description="Backend-specific settings.")

    @model_validator(mode="after")
    def _layers_need_checkpointing(self) -> TrainerConfig:
        if self.checkpoint_layers is not None and not self.gradient_checkpointing:
            raise ValueError("checkpoint_layers needs gradient_checkpointing: true")
        return self


class LogProbConfig(EngineSection):
    """A forward-only engine, e.g. the frozen reference model for a KL penalty."""

    SECTION = "reference"

    backend: str = Field("deepspeed", description=(
        "Log-prob backend, by plugin name: deepspeed or torch (arctic-zorro), ray (another backend in a Ray actor)."))
    model: ModelConfig | None = Field(None, description="Defaults to the policy's initial weights.")
    micro_batch_tokens: Annotated[int, Field(gt=0)] = Field(16384, description="Token budget of one micro-batch.")
    options: dict[str, Any] = Field(default_factory=dict, description="Backend-specific settings.")


class SamplerConfig(EngineSection):
    """The engine behind ``generate``."""

    SECTION = "sampler"
    backend: str = Field("embedded", description=(
        "Sampling backend, by plugin name: embedded or hf-generate (arctic-fca), vllm (arctic-fca[vllm]), "
        "ray (replicas of another backend)."))
    max_batch_size: Annotated[int, Field(gt=0)] = Field(256, description="Sequences sampled together at most.")
    options: dict[str, Any] = Field(default_factory=dict, description="Backend-specific settings.")


class WeightSyncConfig(StrictModel):
    """How the trainer's weights reach the samplers after each ``sync_weights``."""

    transport: str = Field("inprocess", description=(
        "Weight transport, by plugin name: inprocess, safetensors-files, torch-broadcast (Ray actors, gloo "
        "or NCCL), cuda-ipc (Ray actors on one GPU)."))
    bucket_bytes: Annotated[int, Field(gt=0)] = Field(256 * 2**20, description="Bytes per broadcast bucket.")
    options: dict[str, Any] = Field(default_factory=dict, description="Transport-specific settings.")

    def checked_options[M: BaseModel](self, model: type[M]) -> M:
        """``options`` checked by the transport's own model; errors name the full path."""
        return validate(model, self.options, f"weight_sync.options of transport {self.transport!r}",
                        prefix="weight_sync.options.")


class ServerConfig(StrictModel):
    """How many calls the server takes at once."""

    max_generate_calls: Annotated[int, Field(gt=0)] = Field(1024, description=(
        "Generate calls in flight at most (running in the sampler's batch or waiting for it); one more is "
        "answered 'busy' (ServerBusy; HTTP 429 with Retry-After, which the clients wait out and retry) "
        "rather than queued without bound."))


class NoOptions(StrictModel):
    """The options of a plugin that takes none: any key is refused."""


class ArcticConfig(StrictModel):
    """Everything a server needs: the policy model and its engines."""

    model: ModelConfig = Field(description="The policy's weights (the only required setting).")
    trainer: TrainerConfig = Field(TrainerConfig(), description="The engine behind fwd_bwd, step and log_probs.")
    sampler: SamplerConfig = Field(SamplerConfig(), description="The engine behind generate.")
    reference: LogProbConfig | None = Field(None,
                                            description="Set (`reference: {}`) to serve reference log-probs (KL).")
    weight_sync: WeightSyncConfig = Field(WeightSyncConfig(), description="How sync_weights moves the weights.")
    colocate: bool = Field(False, description=(
        "Engines share one device: before each call the server puts to sleep the engines it does not "
        "need and wakes those it does, so one engine's memory is resident at a time (weight sync wakes both)."))
    seed: Seed = Field(0, description="Seeds weights' random parts, sampling without a request seed, and the engines.")
    server: ServerConfig = Field(ServerConfig(), description="Calls in flight at once.")

    def with_local_models(self) -> ArcticConfig:
        """This config with every model path a local folder: Hub models fetched into the Hub's cache
        (later starts find them there), anything else refused naming its setting."""
        reference = self.reference
        if reference is not None and reference.model is not None:
            reference = reference.model_copy(update={"model": reference.model.local("reference.model")})
        return self.model_copy(update={"model": self.model.local("model"), "reference": reference})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArcticConfig:
        return validate(cls, data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ArcticConfig:
        return load_yaml(cls, path)

    @classmethod
    def of(cls, source: ConfigSource) -> ArcticConfig:
        """``source`` as a config: a config as it is, a dict validated, a path read as YAML."""
        if isinstance(source, ArcticConfig):
            return source
        if isinstance(source, str | Path):
            return cls.from_yaml(source)
        if not isinstance(source, dict):
            raise ConfigError(f"a config is an ArcticConfig, a dict or the path of a YAML file, got "
                              f"{type(source).__name__}")
        return cls.from_dict(source)


type ConfigSource = ArcticConfig | dict[str, Any] | str | Path
"""What the clients and :meth:`ArcticConfig.of` take as a config: the config, its dict, or a YAML file."""


# Logits divided by a tinier temperature or repetition penalty overflow to inf (and the log-probs
# to NaN); vLLM treats temperatures below the same value as numerically unsafe.
MIN_TEMPERATURE = 0.01
# The temperature of a scoring or training call (sampling's may also be 0: greedy).
Temperature = Annotated[float, Field(ge=MIN_TEMPERATURE, allow_inf_nan=False)]


class SamplingParams(StrictModel):
    """How to sample; validated before any work starts."""

    n: Annotated[int, Field(ge=1, le=4096)] = Field(1, description="Samples per prompt (a GRPO group).")
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        1.0, description="0 is greedy; otherwise at least 0.01.")
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(1.0, description="Nucleus sampling; 1 disables it.")
    top_k: Annotated[int, Field(ge=0)] = Field(0, description="0 disables top-k.")
    min_p: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0, description="Keep tokens at least min_p times as likely as the most likely one; 0 disables it.")
    repetition_penalty: Annotated[float, Field(ge=MIN_TEMPERATURE, allow_inf_nan=False)] = Field(
        1.0, description="Logits of tokens already in the prompt or output: positive ones divided by it, negative "
        "ones multiplied (transformers' rule); 1 disables it.")
    max_tokens: Annotated[int, Field(ge=1)] = Field(256, description="New tokens per sample at most.")
    stop_token_ids: list[TokenId] = Field(
        default_factory=list, description="Tokens that end a sample (kept in it), besides the model's "
        "end-of-sequence ids (as in vLLM).")
    ignore_eos: bool = Field(False, description="The model's end-of-sequence ids do not end a sample (only "
                             "stop_token_ids and max_tokens do).")
    seed: Seed | None = Field(None, description="Same seed, same samples; None: the engine's own sequence.")

    @field_validator("temperature")
    @classmethod
    def _greedy_or_at_least_the_floor(cls, temperature: float) -> float:
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"{temperature} is below {MIN_TEMPERATURE}: use 0 for greedy sampling")
        return temperature

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class LossTermConfig(BaseModel):
    """One loss term by plugin name, with its options (checked by the term itself)."""

    model_config = ConfigDict(extra="allow")
    name: str
    weight: Annotated[float, Field(allow_inf_nan=False)] = 1.0

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def format_validation_error(exc: ValidationError, what: str, model: type[BaseModel] | None = None,
                            prefix: str = "") -> str:
    """One line per problem, each naming its full path (``prefix`` + the field's location); an
    unknown key also lists the valid keys there, with the closest one as a suggestion."""
    problems: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = [part for part in err["loc"] if not _union_member(part)]
        where = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "(root)"
        message = err["msg"]
        if err["type"] == "extra_forbidden" and model is not None:
            message = _unknown_key(model, err["loc"])
        problems.setdefault(where, []).append(message)
    # A value that fits none of a field's types gets one line: each type's complaint, joined by "or".
    lines = [f"  {where}: {' or '.join(messages)}" for where, messages in problems.items()]
    if len(lines) > MAX_PROBLEMS:  # e.g. a text where token ids belong: one problem per character
        lines[MAX_PROBLEMS:] = [f"  ... and {len(lines) - MAX_PROBLEMS} more problems"]
    return "\n".join([f"invalid {what}:", *lines])


MAX_PROBLEMS = 10  # problems an error lists


def _union_member(part: str | int) -> bool:
    """Whether a location part is pydantic's tag of one member of a union (``constrained-int``,
    ``literal['auto']``), not a key: the user never wrote it."""
    return isinstance(part, str) and not part.replace("_", "").isalnum()


def _unknown_key(model: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    parent = _model_at(model, loc[:-1])
    if parent is None:
        return "unknown key"
    if not parent.model_fields:
        return "unknown key; this takes no options"
    return unknown_key(str(loc[-1]), parent.model_fields)


def unknown_key(key: str, valid: Iterable[str], where: str = "") -> str:
    """Why ``key`` is refused where only the ``valid`` keys are taken: the closest valid key as a
    suggestion, then all of them. ``where`` (" in [trainer]") follows "unknown key"."""
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key{where}{hint}; valid keys: {', '.join(valid)}"


def _model_at(model: type[BaseModel] | None, loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at ``loc`` under ``model`` (None if not a model)."""
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):  # an item of a list or tuple: the same annotation holds it
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field is not None else None
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):  # Optional[M], list[M], Annotated[M, ...]
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def validate[M: BaseModel](model: type[M], data: Any, what: str | None = None, prefix: str = "") -> M:
    """``model.model_validate(data)`` with a readable :class:`ConfigError` on failure; ``prefix``
    is where ``data`` sits in a larger config (``"trainer.options."``)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, what or model.__name__, model, prefix)) from None


def validate_options[M: BaseModel](model: type[M], section: EngineSection, backend: str) -> M:
    """A backend's ``options`` checked by the backend's own model; errors name the full path
    (``trainer.options.zero_stage``) and the backend."""
    path = f"{section.SECTION}.options"
    return validate(model, section.options, f"{path} of backend {backend!r}", prefix=f"{path}.")


def load_yaml[M: BaseModel](model: type[M], path: str | Path) -> M:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:  # missing, binary, or not YAML
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    return validate(model, data or {}, f"config {path}")
