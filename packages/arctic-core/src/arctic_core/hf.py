"""Helpers shared by engines built on Hugging Face transformers models."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from arctic_core.batch import RolloutBatch
from arctic_core.config import ModelConfig, SamplingParams
from arctic_core.errors import ConfigError, RequestError
from arctic_core.quiet import verbose

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"the model's device {name!r}: no CUDA device is visible on this machine "
                          "(use 'cpu' or 'auto')")
    return device


def load_causal_lm(config: ModelConfig) -> PreTrainedModel:
    """Load a causal LM from a local folder onto the configured device and dtype (SDPA attention)."""
    try:
        with _no_loading_bar():
            model = AutoModelForCausalLM.from_pretrained(
                config.path, dtype=DTYPES[config.dtype], attn_implementation="sdpa"
            )
    except (OSError, ValueError, SafetensorError, RuntimeError) as exc:  # missing, damaged, or not this config's shapes
        raise ConfigError(f"cannot load model from {config.path!r}: {exc}") from exc
    return model.to(resolve_device(config.device))


@contextlib.contextmanager
def _no_loading_bar() -> Iterator[None]:
    """No "Loading weights" bar for each engine that loads the model (a server loads it several
    times, a library user's too), unless verbose."""
    if verbose() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


@torch.no_grad()
def copy_weights_(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy named tensors into ``model``'s parameters/buffers in place; returns how many were copied."""
    targets = model.state_dict(keep_vars=True)
    count = 0
    for name, tensor in weights:
        target = targets.get(name)
        if target is None:
            raise RequestError(f"weight {name!r} does not exist in the receiving model")
        if target.shape != tensor.shape:
            raise RequestError(f"weight {name!r} has shape {list(tensor.shape)}, expected {list(target.shape)}")
        target.data.copy_(tensor, non_blocking=True)
        count += 1
    return count


def check_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse ``weights`` (from ``where``) unless they are exactly ``model``'s: the same names and
    shapes. Checked whole before a copy, which would otherwise stop half-way at the first misfit."""
    difference = shapes_difference({name: list(t.shape) for name, t in model.state_dict().items()},
                                   {name: list(t.shape) for name, t in weights.items()})
    if difference:
        raise RequestError(f"the weights in {where} do not fit the model: {difference}")


def shapes_difference(expected: Mapping[str, list[int]], found: Mapping[str, list[int]]) -> str | None:
    """How the tensors ``found`` (name -> shape) differ from the ``expected`` ones, in a few words;
    None if they do not."""
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or unexpected:
        return (f"missing {missing[:5]}, unexpected {unexpected[:5]} "
                f"({len(missing)} missing and {len(unexpected)} unexpected in all)")
    for name, shape in found.items():
        if shape != expected[name]:
            return f"{name!r} has shape {shape}, the model's {expected[name]}"
    return None


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise RequestError(f"{what} contain token id {int(ids.max())} >= vocab size {vocab_size}")


def max_positions(model: PreTrainedModel | PretrainedConfig) -> int:
    """The positions the model (or its config) was built for (``max_position_embeddings``; 65,536
    where unset)."""
    config = model if isinstance(model, PretrainedConfig) else model.config
    return getattr(config.get_text_config(), "max_position_embeddings", None) or 1 << 16


def check_batch_fits(batch: RolloutBatch, model: PreTrainedModel | PretrainedConfig) -> None:
    """Refuse a batch with token ids outside ``model``'s vocabulary or a sequence (prompt and
    response) longer than its positions: past them a model computes garbage or fails deep inside."""
    config = model if isinstance(model, PretrainedConfig) else model.config
    vocab_size = config.get_text_config().vocab_size
    check_token_ids(batch.prompt_ids, vocab_size, "prompts")
    check_token_ids(batch.response_ids, vocab_size, "responses")
    if batch.num_responses:
        lengths = batch.prompt_lens[batch.prompt_index] + batch.response_lens
        longest, limit = int(lengths.max()), max_positions(model)
        if longest > limit:
            raise RequestError(f"response {int(lengths.argmax())} with its prompt has {longest} tokens, more than the "
                               f"model's max_position_embeddings={limit}")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, params: SamplingParams,
                  max_model_len: int) -> None:
    """Refuse, naming the prompt, an empty prompt, a token id outside the vocabulary or a prompt
    with no room left for ``max_tokens`` more, and a stop id no sample can ever draw (samplers are
    called directly too, not only behind the protocol's own checks)."""
    max_tokens = params.max_tokens
    beyond = [t for t in params.stop_token_ids if t >= vocab_size]
    if beyond:
        raise RequestError(f"stop_token_ids {beyond} are >= the vocabulary size {vocab_size}: no sample can draw them")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise RequestError(f"prompts[{i}] is empty")
        if min(prompt) < 0:
            raise RequestError(f"prompts[{i}] contain a negative token id {min(prompt)}")
        check_token_ids(torch.tensor(prompt), vocab_size, f"prompts[{i}]")
        if len(prompt) + max_tokens > max_model_len:
            raise RequestError(f"prompts[{i}] ({len(prompt)} tokens) + max_tokens={max_tokens} exceeds "
                               f"max_model_len={max_model_len}")


def set_attention_implementation(model: torch.nn.Module, name: str) -> None:
    """Point ``model`` at a registered attention function by name (read at call time by each layer)."""
    for sub in model.modules():  # some models keep per-submodule configs (e.g. text_config)
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def enable_gradient_checkpointing(model: PreTrainedModel, layers: int | None = None) -> None:
    """Recompute decoder layers' activations in the backward pass instead of keeping them: every
    layer (``layers`` None) or only the first ``layers`` (:func:`checkpoint_first_layers`). Takes
    effect in training mode only (transformers' rule)."""
    kwargs = {"use_reentrant": False}  # a reentrant checkpoint drops the gradients of keyword inputs
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if layers is not None:
        checkpoint_first_layers(model, layers)


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The layers transformers can checkpoint, in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_first_layers(model: PreTrainedModel, layers: int) -> None:
    """Checkpoint only the first ``layers`` decoder layers (checkpointing enabled). The first ones,
    because the backward pass runs the last layers first: their kept activations are freed before
    any layer is recomputed, so the peak stays at the forward's end (the checkpointed layers'
    inputs plus the others' activations)."""
    blocks = decoder_layers(model)
    if layers > len(blocks):
        raise ConfigError(f"checkpoint_layers ({layers}) exceeds the model's {len(blocks)} decoder layers")
    for index, block in enumerate(blocks):
        block.gradient_checkpointing = index < layers


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "generation_config.json",
)
"""What a Hugging Face folder holds beside the weights that a user of an export needs: the
tokenizer (every format transformers saves), its chat template, and the generation defaults."""


def copy_tokenizer_files(source: str | Path, target: Path) -> list[str]:
    """Copy the tokenizer, chat template and generation config of the model folder ``source``
    into the export ``target`` (files the export already has are kept); returns the names copied.
    Without them ``AutoTokenizer.from_pretrained(target)`` would not find the policy's tokenizer."""
    copied = []
    for name in TOKENIZER_FILES:
        src, dst = Path(source) / name, target / name
        if src.is_file() and not dst.exists():
            shutil.copyfile(src, dst)
            copied.append(name)
    return copied


def token_id_list(value: int | Sequence[int] | None) -> list[int]:
    """A config's token id setting (one id, a list of them, or none) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def generation_config(model: str) -> GenerationConfig | None:
    """The ``generation_config.json`` of the model folder ``model`` (None without one): vLLM's
    defaults for chat sampling, and the end-of-sequence ids that end its samples."""
    try:
        return GenerationConfig.from_pretrained(model)
    except OSError:
        return None


def stop_tokens(model: PreTrainedModel, params: SamplingParams) -> set[int]:
    """What ends a sample, as in vLLM: the request's stop ids and, unless ``ignore_eos``, the
    model's end-of-sequence ids (generation config first)."""
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None:
        eos = model.config.eos_token_id
    eos_ids = [] if params.ignore_eos else token_id_list(eos)
    return set(params.stop_token_ids) | set(eos_ids)
