"""ZoRRo Train's forward: the batch as a packed prefix forest, logits only where they are needed.

Model-agnostic: it runs the model's own decoder (``model.base_model``) on the packed tokens with
their original position ids, switches attention to :mod:`arctic_zorro.forest_attention` through
transformers' registry, and applies the LM head to the hidden states that predict response tokens
only. Per-response outputs come back in the batch's row order, exactly as the plain forward's.
"""

from __future__ import annotations

import functools

from collections.abc import Callable, Mapping

import torch
from pydantic import Field
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from arctic_core.batch import RolloutBatch, to_device
from arctic_core.config import StrictModel
from arctic_core.errors import ConfigError
from arctic_core.hf import set_attention_implementation
from arctic_core.plugins.interfaces import Processor
from arctic_zorro.forest import build_forest, response_gather_index
from arctic_zorro.forest_attention import ATTENTION_NAME, ForestAttentionMeta
from arctic_zorro.forward import response_outputs, run_processors, scatter_values
from arctic_zorro.memory_budget import HEAD_BYTES_PER_LOGIT, activation_budget

_INEXACT_CONFIG = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "alibi": "ALiBi position bias",
    "logit_scale": "scaled output logits",
}


HEAD_CHUNK_TOKENS = 2048


class ZorroOptions(StrictModel):
    """``options: {zorro: {enable: false}}`` in a trainer config turns prompt deduplication off."""

    enable: bool = True
    """Pack each distinct prompt once per micro-batch (exact); false: one padded row per response."""
    head_chunk_tokens: int = Field(HEAD_CHUNK_TOKENS, gt=0, description=(
        "Response tokens per LM-head chunk: where the free device memory cannot hold every chunk's "
        "full-vocabulary logits until the backward, one chunk's logits (and their gradient) live at a "
        "time, so smaller chunks lower the peak memory at some launch cost."))


def check_supported(model: PreTrainedModel) -> None:
    """Refuse, by name, model features the packed forward cannot reproduce exactly."""
    config = model.config
    for attribute, what in _INEXACT_CONFIG.items():
        if getattr(config, attribute, None) not in (None, False, 0, 1.0):
            raise ConfigError(f"zorro cannot run {config.model_type} exactly ({what}); set options.zorro.enable: false")
    if model.get_output_embeddings() is None or not hasattr(model, "base_model"):
        raise ConfigError(f"zorro needs a causal LM with an output embedding; {type(model).__name__} has none")


def enable_forest_attention(model: PreTrainedModel) -> None:
    """Route every attention layer of ``model`` to the forest attention (masks are then skipped)."""
    check_supported(model)
    set_attention_implementation(model, ATTENTION_NAME)


def packed_response_outputs(
    model: PreTrainedModel, batch: RolloutBatch, processors: Mapping[str, Processor],
    head_chunk_tokens: int = HEAD_CHUNK_TOKENS,
) -> dict[str, torch.Tensor]:
    """Per-token processor outputs ``[B, Lr]`` from one pass over the deduplicated batch."""
    device = next(model.parameters()).device
    batch = batch.to("cpu")  # the forest is built on the host, once per micro-batch
    forest = build_forest(batch)
    rows, cols, nodes = response_gather_index(forest, batch)
    targets = to_device(batch.response_ids[rows, cols], device)
    forest = forest.to(device)
    meta = ForestAttentionMeta.build(forest, model.dtype)
    hidden = model.base_model(
        input_ids=forest.input_ids[None], position_ids=forest.position_ids[None], forest=meta, use_cache=False
    ).last_hidden_state[0]
    # A prompt's last node predicts the first token of each of its responses: ``nodes`` repeats it.
    # index_select's backward adds those rows in order (index_add); ``hidden[nodes]`` would add
    # them with parallel atomics on the CPU, in an order that changes from run to run.
    picked = hidden.index_select(0, to_device(nodes, device))
    values = head_outputs(model.get_output_embeddings(), picked, targets, processors, head_chunk_tokens)
    return scatter_values(values, batch, rows, cols)


def head_outputs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, processors: Mapping[str, Processor],
    chunk_tokens: int = HEAD_CHUNK_TOKENS,
) -> dict[str, torch.Tensor]:
    """LM head + processors in chunks of response tokens.

    A full-vocabulary logits tensor for every response token (tokens x 150k, several GB) exists at
    once only where the free device memory holds it: then each chunk's logits stay alive for the
    backward; else each chunk is recomputed in the backward, and one chunk's logits live at a time.
    """
    names: list[str] = []

    def chunk_values(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = run_processors(head(h), t, processors)
        names[:] = list(values)
        return tuple(values.values())

    recompute = torch.is_grad_enabled() and not logits_fit(hidden, getattr(head, "out_features", 0), chunk_tokens)
    parts = [
        checkpoint(chunk_values, h, t, use_reentrant=False) if recompute else chunk_values(h, t)
        for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True)
    ]
    if not parts:  # no response tokens at all
        return {o: hidden.new_zeros(0, dtype=torch.float32) for p in processors.values() for o in p.outputs}
    return {name: torch.cat([p[i] for p in parts]) for i, name in enumerate(names)}


def logits_fit(hidden: torch.Tensor, vocab: int, chunk_tokens: int) -> bool:
    """Whether the logits of every row of ``hidden`` can stay alive until the backward, beside one
    chunk's backward (its gradient and the processors' work), in the device memory free now: kept,
    the backward does not run the chunks' LM-head product and processors again. Off CUDA there is
    no budget to check, and with several ranks each could decide otherwise (under ZeRO-3 a
    recomputed chunk gathers the head's weight again, a collective every rank must join): there
    the chunks are recomputed."""
    budget = activation_budget(hidden.device)
    if budget is None or not vocab or several_ranks():
        return False
    rows = hidden.shape[0]
    kept = rows * vocab * hidden.element_size()
    return kept + min(rows, chunk_tokens) * vocab * HEAD_BYTES_PER_LOGIT <= budget


def several_ranks() -> bool:
    """Whether this process trains as one of several ranks (a process group of more than one)."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


Forward = Callable[[PreTrainedModel, RolloutBatch, Mapping[str, Processor]], dict[str, torch.Tensor]]


def select_forward(model: PreTrainedModel, options: ZorroOptions) -> Forward:
    """The packed forward (switching ``model`` to forest attention) or, when disabled, the plain one."""
    if not options.enable:
        return response_outputs
    enable_forest_attention(model)
    return functools.partial(packed_response_outputs, head_chunk_tokens=options.head_chunk_tokens)
