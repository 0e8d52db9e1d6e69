"""The rollout batch: grouped <-> padded round trips, ragged lengths, validation errors."""

from __future__ import annotations

import pytest
import torch

from arctic_core.batch import RolloutBatch
from arctic_core.errors import BatchError


def ragged_batch() -> RolloutBatch:
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[1, 2], [3], [], [4, 4, 4, 4], [2, 1]]
    index = [0, 0, 1, 2, 2]
    logp = -torch.rand(5, 4, dtype=torch.float32)
    logp = logp * RolloutBatch.from_lists(prompts, responses, index).response_token_mask()
    return RolloutBatch.from_lists(prompts, responses, index, old_logprobs=logp, advantages=torch.arange(5.0))


def test_grouped_batch_knows_which_rows_share_a_prompt():
    batch = ragged_batch()
    assert batch.groups() == [[0, 1], [2], [3, 4]]
    assert batch.prompt(1) == [5, 6, 7] and batch.response(3) == [4, 4, 4, 4] and batch.response(2) == []
    assert batch.total_tokens() == 3 + 2 + 3 + 1 + 1 + 0 + 2 + 4 + 2 + 2


def test_to_padded_left_pads_prompts_and_right_pads_responses():
    padded = ragged_batch().to_padded(pad_id=0)
    assert padded["input_ids"].tolist()[1] == [5, 6, 7, 3, 0, 0, 0]
    assert padded["input_ids"].tolist()[2] == [0, 0, 8, 0, 0, 0, 0]
    assert padded["attention_mask"].tolist()[3] == [0, 1, 1, 1, 1, 1, 1]
    assert padded["position_ids"].tolist()[3] == [0, 0, 1, 2, 3, 4, 5]
    assert padded["response_mask"].tolist()[0] == [1, 1, 0, 0]


def test_padded_round_trip_with_group_ids_and_without():
    batch = ragged_batch()
    padded = batch.to_padded()
    prompt_width = batch.prompt_ids.shape[1]
    for group_ids in (None, ["a", "a", "b", "c", "c"]):
        back = RolloutBatch.from_padded(
            padded["input_ids"], padded["attention_mask"], prompt_width, group_ids=group_ids,
            old_logprobs=batch.old_logprobs, advantages=batch.advantages,
        )
        assert back.groups() == batch.groups()
        for name, tensor in batch.to_tensors().items():
            assert torch.equal(getattr(back, name), tensor), name


def test_from_padded_groups_identical_prompts_exactly_and_keeps_a_loss_mask():
    ids = torch.tensor([[0, 4, 5, 9, 9], [0, 4, 5, 8, 0], [3, 4, 5, 7, 7]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    loss_mask = torch.tensor([[1, 0], [1, 1], [1, 1]])
    batch = RolloutBatch.from_padded(ids, mask, prompt_length=3, response_mask=loss_mask)
    assert batch.num_prompts == 2 and batch.groups() == [[0, 1], [2]]
    assert batch.loss_mask.tolist() == [[True, False], [True, False], [True, True]]


def test_from_padded_equals_the_batch_built_from_token_lists():
    """Random left-padded prompts (some ending in token 0, which is not padding) and right-padded
    responses: the tensor conversion gives what grouping the rows' token lists gives."""
    gen = torch.Generator().manual_seed(0)
    shared = [torch.randint(0, 5, (int(n),), generator=gen).tolist() for n in torch.randint(1, 7, (5,), generator=gen)]
    shared[1] = shared[0] + [0]  # a prompt that differs from another only by a trailing token 0
    rows = [shared[int(i)] for i in torch.randint(0, 5, (12,), generator=gen)]
    responses = [torch.randint(0, 9, (int(n),), generator=gen).tolist()
                 for n in torch.randint(0, 5, (12,), generator=gen)]
    responses[0] = [1, 2, 3, 4]  # the longest response sets the width
    first: dict[tuple[int, ...], int] = {}
    index = [first.setdefault(tuple(p), len(first)) for p in rows]
    expected = RolloutBatch.from_lists(list(map(list, first)), responses, index)
    width_p, width_r = 8, 4
    ids = torch.zeros(12, width_p + width_r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(zip(rows, responses, strict=True)):
        ids[i, width_p - len(prompt): width_p + len(response)] = torch.tensor(prompt + response)
        mask[i, width_p - len(prompt): width_p + len(response)] = 1
    for group_ids in (None, [tuple(p) for p in rows]):
        batch = RolloutBatch.from_padded(ids, mask, width_p, group_ids=group_ids)
        for name, tensor in expected.to_tensors().items():
            assert torch.equal(getattr(batch, name), tensor), name
    with pytest.raises(BatchError, match="integer token ids"):
        RolloutBatch.from_padded(ids.float(), mask, width_p)


def test_group_ids_with_different_prompts_are_refused():
    ids = torch.tensor([[4, 5, 1], [4, 6, 1]])
    with pytest.raises(BatchError, match="row 1 is in group 'g'"):
        RolloutBatch.from_padded(ids, torch.ones_like(ids), 2, group_ids=["g", "g"])


def test_select_keeps_only_used_prompts_and_trims_width():
    sub = ragged_batch().select([3, 1])
    assert sub.num_prompts == 2 and sub.prompt_index.tolist() == [1, 0]
    assert sub.prompt(0) == [9, 10] and sub.response(0) == [4, 4, 4, 4]
    assert sub.advantages.tolist() == [3.0, 1.0]
    assert sub.old_logprobs.shape == (2, 4)


def test_tensor_round_trip_is_lossless():
    batch = ragged_batch()
    batch.extras["uid"] = torch.arange(5)
    back = RolloutBatch.from_tensors(batch.to_tensors())
    assert torch.equal(back.extras["uid"], torch.arange(5))
    assert torch.equal(back.old_logprobs, batch.old_logprobs)


def test_a_moved_batch_holds_every_field_on_the_new_device_without_checking_them_there():
    """``to`` moves each tensor (extras too) and does not validate again: on a GPU each check would
    read a device value and wait for the device's queued work."""
    batch = ragged_batch()
    batch.extras["uid"] = torch.arange(5)
    moved = batch.to("meta")  # a meta tensor holds no values: any check that read one would fail
    for name, value in batch.to_tensors().items():
        twin = moved.to_tensors()[name]
        assert twin.device.type == "meta" and twin.shape == value.shape and twin.dtype == value.dtype, name
    assert batch.prompt_ids.device.type == "cpu" and moved.to("meta") is moved


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt_index": torch.tensor([0, 0, 1, 2, 3])}, "prompt_index must lie in"),
        ({"response_lens": torch.tensor([2, 1, 0, 5, 2])}, r"response_lens\[3\] = 5: over the padded width 4"),
        ({"response_lens": torch.tensor([2, 1, -1, 4, 2])}, r"response_lens\[2\] = -1: response 2 is negative"),
        ({"old_logprobs": torch.zeros(5, 3)}, "old_logprobs must be"),
        ({"old_logprobs": torch.zeros(5, 4, dtype=torch.long)}, "old_logprobs must be a float16, bfloat16, float32"),
        ({"old_logprobs": torch.zeros(5, 4, dtype=torch.float8_e4m3fn)}, "got dtype torch.float8_e4m3fn"),
        ({"rewards": torch.zeros(5, 3)}, r"rewards must be \[B\] = \[5\], got \[5, 3\]"),
        ({"loss_mask": torch.full((5, 4), 0.5)}, "loss_mask must be bool \\(or 0/1\\)"),
        ({"advantages": torch.zeros(4)}, "advantages must be"),
        ({"prompt_ids": torch.zeros(3, 3)}, "prompt_ids must hold integers"),
        ({"response_ids": torch.zeros(5, 4, dtype=torch.uint64)},
         r"response_ids must hold integers \(int64 or int32\)"),
        ({"advantages": torch.tensor([1.0, float("nan"), 0, 0, 0])},
         r"advantages must be finite.*advantages\[1\] = nan"),
        ({"rewards": torch.tensor([1.0, 0, float("inf"), 0, 0])}, r"rewards\[2\] = inf"),
        ({"rewards": torch.zeros(2)}, "rewards has 2 entries"),
        ({"loss_mask": torch.ones(5, 4, dtype=torch.bool)}, "loss_mask marks padding"),
    ],
)
def test_bad_fields_are_named(change, message):
    with pytest.raises(BatchError, match=message):
        ragged_batch().replace(**change)


def test_an_empty_prompt_or_lists_for_padded_tensors_are_named():
    with pytest.raises(BatchError, match=r"prompt_lens\[1\] = 0: prompt 1 is empty"):
        RolloutBatch.from_lists([[1], []], [[3], [4]], [0, 1])
    with pytest.raises(BatchError, match=r"input_ids must be a \[B, T\] tensor, got list \(from_lists takes"):
        RolloutBatch.from_padded([[1, 2]], torch.ones(1, 2), 1)


def test_narrow_integer_ids_are_widened_and_float_ids_refused():
    batch = ragged_batch()
    narrow = batch.replace(response_ids=batch.response_ids.to(torch.int16),
                           prompt_index=batch.prompt_index.to(torch.uint8))
    assert narrow.response_ids.dtype == narrow.prompt_index.dtype == torch.int64  # torch's gathers take int32/64
    assert torch.equal(narrow.response_ids, batch.response_ids)
    with pytest.raises(BatchError, match=r"prompts\[0\] must be a sequence of integer token ids, got torch.float32"):
        RolloutBatch.from_lists([[1, 2.7]], [[3]], [0])


def test_non_finite_values_are_refused_where_a_loss_reads_them_and_zeroed_elsewhere():
    batch = ragged_batch()
    at_padding = torch.where(batch.loss_mask, -1.0, float("nan"))
    masked_row = torch.zeros(batch.num_responses).index_fill(0, torch.tensor([2]), float("nan"))  # row 2 is empty
    cleaned = batch.replace(old_logprobs=at_padding, advantages=masked_row)
    # NaN x 0 is NaN in a masked product and in its gradient: such entries must not reach a loss.
    assert torch.equal(cleaned.old_logprobs, torch.where(batch.loss_mask, -1.0, 0.0))
    assert torch.equal(cleaned.advantages, torch.zeros(batch.num_responses))
    with pytest.raises(BatchError, match=r"old_logprobs must be finite.*old_logprobs\[0, 0\] = -inf"):
        batch.replace(old_logprobs=torch.where(batch.loss_mask, float("-inf"), 0.0))


def test_log_probs_that_cannot_be_any_are_refused():
    """Negative log-likelihoods or probabilities passed as log-probs would train silently (the PPO
    ratio's clipping hides them): one above 1, or all above 0, is refused with where it is."""
    batch = ragged_batch()
    plausible = torch.where(batch.loss_mask, -0.5, 7.0)  # padding is never read
    plausible[0, 0] = 0.01  # rounding near 0 (bf16 logits) is accepted
    assert torch.equal(batch.replace(ref_logprobs=plausible).ref_logprobs, plausible)
    with pytest.raises(BatchError, match=r"old_logprobs must be log-probabilities \(at most 0\), got "
                                         r"old_logprobs\[1, 0\] = 2.5; were negative log-likelihoods"):
        wrong = torch.where(batch.loss_mask, -0.5, 0.0)
        wrong[1, 0] = 2.5
        batch.replace(old_logprobs=wrong)
    probabilities = torch.where(batch.loss_mask, 0.3, 0.0)
    with pytest.raises(BatchError, match=r"sampling_logprobs must be log-probabilities.*= 0.3 and no entry below 0"):
        batch.replace(sampling_logprobs=probabilities)


def test_from_tensors_names_unknown_and_missing_fields():
    tensors = ragged_batch().to_tensors()
    with pytest.raises(BatchError, match="unknown batch field"):
        RolloutBatch.from_tensors({**tensors, "bogus": torch.zeros(1)})
    del tensors["prompt_index"]
    with pytest.raises(BatchError, match="missing required batch field.*prompt_index"):
        RolloutBatch.from_tensors(tensors)
