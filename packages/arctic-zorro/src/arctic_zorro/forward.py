"""The plain forward pass of the reference engines: one padded row per response.

Each row is ``prompt + response`` right-padded; logits are gathered only at the positions that
predict response tokens and handed to the processors, whose per-token outputs are scattered back
into ``[B, Lr]`` tensors in the batch's row order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.interfaces import Processor


def _rows(batch: RolloutBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = batch.prompt_lens[batch.prompt_index] + batch.response_lens
    ids = torch.zeros(batch.num_responses, int(lengths.max()), dtype=torch.long)
    for i in range(batch.num_responses):
        seq = batch.prompt(i) + batch.response(i)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return ids.to(device), mask.long().to(device)


def response_outputs(
    model: torch.nn.Module, batch: RolloutBatch, processors: Mapping[str, Processor]
) -> dict[str, torch.Tensor]:
    """Run ``model`` on every row and return each processor output as ``[B, Lr]`` (float32)."""
    device = next(model.parameters()).device
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
    device = logits.device
    rows, cols = rows.to(device), cols.to(device)
    targets = batch.response_ids.to(device)[rows, cols]
    shape = tuple(batch.response_ids.shape)
    out: dict[str, torch.Tensor] = {}
    for processor in dict.fromkeys(processors.values()):
        for name, values in processor(logits, targets).items():
            out[name] = torch.zeros(shape, dtype=values.dtype, device=device).index_put((rows, cols), values)
    return out
