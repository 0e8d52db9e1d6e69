"""The plain forward pass (ZoRRo off): one padded row per response.

Each row is ``prompt + response`` right-padded; logits are gathered only at the positions that
predict response tokens and handed to the processors, whose per-token outputs are scattered back
into ``[B, Lr]`` tensors in the batch's row order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from arctic_core.batch import RolloutBatch, to_device
from arctic_core.losses.objective import check_processor_outputs
from arctic_core.losses.processors import sharing
from arctic_core.plugins.interfaces import Processor


def _rows(batch: RolloutBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = batch.sequence_lens()
    ids = torch.zeros(batch.num_responses, int(lengths.max()), dtype=torch.long)
    for i in range(batch.num_responses):
        seq = batch.prompt(i) + batch.response(i)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return to_device(ids, device), to_device(mask.long(), device)


def response_outputs(
    model: torch.nn.Module, batch: RolloutBatch, processors: Mapping[str, Processor]
) -> dict[str, torch.Tensor]:
    """Run ``model`` on every row and return each processor output as ``[B, Lr]`` (float32)."""
    device = next(model.parameters()).device
    batch = batch.to("cpu")  # index bookkeeping happens on the host (a no-op for CPU batches)
    input_ids, attention_mask = _rows(batch, device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    rows = torch.repeat_interleave(torch.arange(batch.num_responses), batch.response_lens)
    cols = torch.cat([torch.arange(int(n)) for n in batch.response_lens]) if len(rows) else rows
    positions = batch.prompt_lens[batch.prompt_index][rows] - 1 + cols  # the logit that predicts (row, col)
    picked = logits[rows.to(device), positions.to(device)]
    return scatter_outputs(picked, batch, rows, cols, processors)


def scatter_outputs(
    logits: torch.Tensor,
    batch: RolloutBatch,
    rows: torch.Tensor,
    cols: torch.Tensor,
    processors: Mapping[str, Processor],
) -> dict[str, torch.Tensor]:
    """Run the processors on ``logits [N, V]`` (one per response token ``(rows, cols)``) -> ``[B, Lr]`` each."""
    targets = batch.response_ids.to(logits.device)[rows.to(logits.device), cols.to(logits.device)]
    return scatter_values(run_processors(logits, targets, processors), batch, rows, cols)


def run_processors(logits: torch.Tensor, targets: torch.Tensor,
                   processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]:
    """Every processor once (one may produce several outputs) -> ``{output: [N]}``."""
    out: dict[str, torch.Tensor] = {}
    with sharing():  # log-probs and entropy from one kernel launch each way on a GPU
        for processor in dict.fromkeys(processors.values()):
            produced = processor(logits, targets)
            check_processor_outputs(processor, produced, targets.shape[0])
            out.update(produced)
    return out


def scatter_values(values: Mapping[str, torch.Tensor], batch: RolloutBatch, rows: torch.Tensor,
                   cols: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token ``[N]`` values into ``[B, Lr]`` tensors (zeros at padding), keeping autograd."""
    if not values:
        return {}
    shape, device = tuple(batch.response_ids.shape), next(iter(values.values())).device
    index = (to_device(rows, device), to_device(cols, device))  # once for every output
    return {name: torch.zeros(shape, dtype=v.dtype, device=device).index_put(index, v) for name, v in values.items()}
