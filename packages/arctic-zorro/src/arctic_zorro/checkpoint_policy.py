"""``checkpoint_layers: auto``: before each micro-batch, checkpoint as few decoder layers as the
free device memory allows, keeping the activations of the others.

Recomputing a checkpointed layer costs most of its forward again (figures in docs/design/zorro.md),
while a kept layer costs memory in proportion to the micro-batch's tokens. Which layers are
checkpointed changes no result, only the time and the peak memory.

A kept layer's activations are estimated from the model's shape (what autograd saves for a
Llama-shaped layer: the two RMSNorms' fp32 inputs and normalised values, the projections' outputs,
the query/key norms' fp32 inputs, the attention's inputs and output, the MLP's four
intermediates). For that shape in bf16 the estimate is 120 KB per token, against 109-113 KB
measured (0.83 GiB per kept layer at 8,192 tokens, 2.5 GiB at 24,576): on the safe side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from transformers import PreTrainedModel, PretrainedConfig

from arctic_core.batch import RolloutBatch
from arctic_core.config import TrainerConfig
from arctic_core.hf import checkpoint_first_layers, decoder_layers
from arctic_core.plugins.interfaces import Processor
from arctic_zorro.memory_budget import HEAD_BYTES_PER_LOGIT, activation_budget
from arctic_zorro.micro_batches import MicroForward as Forward
from arctic_zorro.micro_batches import micro_batch_tokens
from arctic_zorro.packed_forward import ZorroOptions, several_ranks

log = logging.getLogger(__name__)


def fixed_layers(config: TrainerConfig) -> int | None:
    """The checkpointed layer count to start with: the configured one, or every layer for "auto"."""
    return None if config.checkpoint_layers == "auto" else config.checkpoint_layers


def kept_layer_bytes(config: PretrainedConfig, dtype_bytes: int) -> int:
    """Activations one kept decoder layer holds per token until the backward pass reaches it."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    norms = 2 * (2 * 4 * hidden + dtype_bytes * hidden)  # fp32 input and normalised; the output
    attention = dtype_bytes * (q + 2 * kv) * 2 + 4 * (q + kv) + dtype_bytes * q  # projections, q/k norms, output
    mlp = 4 * dtype_bytes * intermediate  # gate, up, SiLU(gate), their product
    return norms + attention + mlp


def layers_to_checkpoint(num_layers: int, tokens: int, kept_bytes: int, input_bytes: int, budget: int) -> int:
    """The fewest first layers to checkpoint so that ``budget`` bytes hold the kept layers'
    activations, the checkpointed layers' inputs and one layer's working set (the layer being
    recomputed or differentiated)."""
    for checkpointed in range(num_layers + 1):
        kept = num_layers - checkpointed
        if tokens * (kept * kept_bytes + checkpointed * input_bytes + kept_bytes) <= budget:
            return checkpointed
    return num_layers


class AutoCheckpointing:
    """Sets ``model``'s checkpointed layers for each micro-batch from its packed token count
    (``tokens_of``) and the head's logits memory (``head_tokens_of``: tokens whose logits are
    alive at once). ``agree``: every rank checkpoints the most layers any rank needs (under ZeRO-3
    a recomputed layer gathers its weights, a collective all ranks must join; the caller runs the
    same number of micro-batches on every rank)."""

    def __init__(self, model: PreTrainedModel, device: torch.device, tokens_of: Callable[[RolloutBatch], int],
                 head_tokens_of: Callable[[RolloutBatch], int], agree: bool = False) -> None:
        self.model, self.device, self.tokens_of, self.head_tokens_of = model, device, tokens_of, head_tokens_of
        self.agree = agree
        self.num_layers = len(decoder_layers(model))
        dtype_bytes = model.dtype.itemsize
        self.kept_bytes = kept_layer_bytes(model.config, dtype_bytes)
        self.input_bytes = model.config.hidden_size * dtype_bytes
        self.checkpointed = self.num_layers

    def before(self, micro: RolloutBatch) -> int:
        """Checkpoint the layers ``micro`` needs; returns how many."""
        budget, tokens = activation_budget(self.device), self.tokens_of(micro)
        checkpointed = self.num_layers
        if budget is not None:
            budget -= self.head_tokens_of(micro) * self.model.config.vocab_size * HEAD_BYTES_PER_LOGIT
            checkpointed = layers_to_checkpoint(self.num_layers, tokens, self.kept_bytes, self.input_bytes, budget)
        if self.agree:
            checkpointed = _most_over_ranks(checkpointed, self.device)
        if checkpointed != self.checkpointed:
            log.info("checkpoint_layers auto: %d of %d layers for %d tokens (%s GiB for activations)", checkpointed,
                     self.num_layers, tokens, "-" if budget is None else f"{budget / 2**30:.1f}")
            checkpoint_first_layers(self.model, checkpointed)
            self.checkpointed = checkpointed
        return checkpointed

    def wrap(self, forward: Forward) -> Forward:
        """``forward(micro, processors)`` with this micro-batch's layers set first."""

        def planned(micro: RolloutBatch, processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]:
            self.before(micro)
            return forward(micro, processors)

        return planned


def training_forward(forward: Forward, config: TrainerConfig, model: PreTrainedModel, device: torch.device,
                     zorro: ZorroOptions, agree: bool = False) -> Forward:
    """A trainer's micro-batch ``forward``, which sets the layers to checkpoint first when
    ``checkpoint_layers`` is auto. The packed forward (ZoRRo) applies the LM head to
    ``head_chunk_tokens`` response tokens at a time, the padded one to every position at once."""
    if config.checkpoint_layers != "auto":
        return forward
    if zorro.enable:
        head_tokens = lambda micro: min(int(micro.response_lens.sum()), zorro.head_chunk_tokens)  # noqa: E731
    else:
        head_tokens = lambda micro: micro_batch_tokens(micro, grouped=False)  # noqa: E731
    policy = AutoCheckpointing(model, device, lambda micro: micro_batch_tokens(micro, zorro.enable), head_tokens, agree)
    return policy.wrap(forward)


def _most_over_ranks(value: int, device: torch.device) -> int:
    if not several_ranks():
        return value
    counts = torch.tensor([value], device=device)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
    return int(counts.item())
