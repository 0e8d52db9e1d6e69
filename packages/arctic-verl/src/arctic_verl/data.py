"""verl's samples (TransferQueue rows of jagged tensors) as Arctic's RolloutBatch.

verl stores one row per sample: its prompt ids, response ids and per-token fields as nested
(jagged) tensors. A RolloutBatch stores each distinct prompt once with an index per response, so
rows whose prompt ids are equal (a GRPO group) share one prompt: the ZoRRo packing Arctic trains
with. Rows keep verl's order, so per-token results line up with verl's keys.
"""

from __future__ import annotations

from tensordict import TensorDict

from arctic_core.batch import RolloutBatch

# verl's field -> RolloutBatch field, for the per-token inputs a step reads.
TOKEN_FIELDS = {"old_log_probs": "old_logprobs", "ref_log_prob": "ref_logprobs",
                "rollout_log_probs": "sampling_logprobs", "advantages": "advantages"}


def to_rollout_batch(data: TensorDict) -> RolloutBatch:
    """Rows with fields ``prompts``, ``responses``, ``response_mask`` (and any of
    :data:`TOKEN_FIELDS`) as one RolloutBatch; equal prompts are stored once."""
    distinct: dict[tuple[int, ...], int] = {}
    prompt_index = [distinct.setdefault(tuple(row.tolist()), len(distinct)) for row in data["prompts"].unbind()]
    responses = [row.tolist() for row in data["responses"].unbind()]
    # Every per-token field of a row has the row's response length: padded, they share one width.
    fields = {"loss_mask": data["response_mask"].to_padded_tensor(0).bool()}
    for verl_name, name in TOKEN_FIELDS.items():
        if verl_name in data.keys():
            fields[name] = data[verl_name].to_padded_tensor(0.0).float()
    return RolloutBatch.from_lists([list(p) for p in distinct], responses, prompt_index, **fields)
