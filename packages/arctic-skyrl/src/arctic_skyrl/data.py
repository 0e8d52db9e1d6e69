"""SkyRL's training batches (padded tensors) as Arctic's RolloutBatch, and Arctic's per-token
outputs back in SkyRL's layout.

SkyRL stores each row as one left-padded ``prompt + response`` sequence and every per-token field
(masks, log-probs, advantages) **right-aligned** in ``[rows, max_response]``. A RolloutBatch stores
each distinct prompt once with an index per response and per-token fields left-aligned, so rows
whose prompts are equal (a GRPO group) share one prompt: the ZoRRo packing Arctic trains with. A
multi-turn step's prompt holds the earlier turns; Arctic's prefix forest packs the turns the rows
share once.
"""

from __future__ import annotations

import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

from arctic_core.batch import RolloutBatch

# SkyRL's field -> RolloutBatch field, for the per-token inputs of a training step.
TOKEN_FIELDS = {"action_log_probs": "old_logprobs", "base_action_log_probs": "ref_logprobs",
                "rollout_logprobs": "sampling_logprobs", "advantages": "advantages"}


def response_lengths(data: TrainingInputBatch) -> torch.Tensor:
    """Each row's response length: its ``response_mask`` count. A forward-only batch carries no
    response mask (SkyRL sends its workers only the sequences): then every row's last
    ``max_response`` tokens (at most all but its first) stand for its response; log-probs are
    per position, so the values SkyRL reads are the same."""
    if data.get("response_mask") is not None:
        return data["response_mask"].sum(-1).long()
    width = int(data.metadata["response_length"])
    return (data["attention_mask"].sum(-1).long() - 1).clamp(max=width)


def left_aligned(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[rows, W]`` right-aligned values as ``[rows, max(lengths)]`` left-aligned ones."""
    width, longest = values.shape[1], int(lengths.max())
    columns = torch.arange(longest)[None, :] + (width - lengths)[:, None]
    valid = torch.arange(longest)[None, :] < lengths[:, None]
    return torch.where(valid, values.gather(1, columns.clamp(0, width - 1)), torch.zeros((), dtype=values.dtype))


def right_aligned(values: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, L]`` left-aligned values (``lengths`` valid each) as ``[rows, width]`` right-aligned."""
    columns = torch.arange(width)[None, :] - (width - lengths)[:, None]
    valid = columns >= 0
    gathered = values.gather(1, columns.clamp(0, max(values.shape[1] - 1, 0)))
    return torch.where(valid, gathered, torch.zeros((), dtype=values.dtype))


def to_rollout_batch(data: TrainingInputBatch, with_fields: bool = True) -> RolloutBatch:
    """Rows of ``data`` (``sequences``, ``attention_mask``; with ``with_fields`` also
    ``loss_mask`` and any of :data:`TOKEN_FIELDS`) as one RolloutBatch; equal prompts stored once."""
    lengths = response_lengths(data)
    real = data["attention_mask"].bool()
    distinct: dict[tuple[int, ...], int] = {}
    prompt_index, responses = [], []
    for row, length in zip(data["sequences"], lengths.tolist(), strict=True):
        tokens = row[real[len(responses)]].tolist()
        prompt_index.append(distinct.setdefault(tuple(tokens[:len(tokens) - length]), len(distinct)))
        responses.append(tokens[len(tokens) - length:])
    fields: dict[str, torch.Tensor] = {}
    if with_fields:
        fields["loss_mask"] = left_aligned(data["loss_mask"], lengths) > 0
        for skyrl_name, name in TOKEN_FIELDS.items():
            if data.get(skyrl_name) is not None:
                fields[name] = left_aligned(data[skyrl_name].float(), lengths)
    return RolloutBatch.from_lists([list(p) for p in distinct], responses, prompt_index, **fields)
