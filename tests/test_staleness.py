"""``fwd_bwd(max_staleness=K)``: tokens drawn more than K weight syncs ago leave the loss, each judged
by its own policy version, and the update is exactly that of the same batch with those tokens
masked by hand; with nothing that old, the batch is trained as given."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient
from arctic_core.errors import RequestError
from arctic_core.staleness import drop_stale
from helpers import random_grpo_batch, weights

LOSS = [{"name": "ppo", "clip_low": 0.2, "clip_high": 0.28}]
TRAINER = {"optimizer": {"lr": 1e-2, "eps": 1.0}}  # a large eps: equal updates mean equal gradients
SYNCS = 2  # the server serves policy version 2: tokens of versions 0, 1, 2 are 2, 1, 0 syncs old


def versioned_batch(vocab: int) -> RolloutBatch:
    """Responses of different lengths drawn by version 0, by 2, or across syncs (0 then 2, 1 then
    2), some tokens masked out of the loss."""
    batch = random_grpo_batch(vocab, samples=3)
    per_token = torch.full(batch.response_ids.shape, SYNCS)
    for row, length in enumerate(batch.response_lens.tolist()):
        kind = row % 4
        if kind == 0:
            per_token[row] = 0
        elif kind == 2:
            per_token[row, : length // 2] = 0
        elif kind == 3:
            per_token[row, : length // 2] = 1
    mask = batch.loss_mask.clone()
    mask[1::5, 0] = False  # masked tokens of several versions
    return batch.replace(token_policy_version=per_token, policy_version=per_token.amin(1), loss_mask=mask)


@pytest.fixture
def vocab(tiny_policy) -> int:
    return AutoConfig.from_pretrained(tiny_policy).vocab_size


def trained(arctic_config, batch: RolloutBatch, **kwargs) -> tuple[dict, dict[str, torch.Tensor]]:
    """fwd_bwd's metrics and the weights after the step, on a fresh server at version SYNCS."""
    with ArcticClient.in_process(arctic_config(trainer=TRAINER)) as client:
        for _ in range(SYNCS):
            client.sync_weights()
        metrics = client.fwd_bwd(batch, LOSS, **kwargs).metrics
        client.step()
        return metrics, weights(client)


def test_tokens_older_than_the_bound_leave_the_loss_and_the_rest_trains_exactly(arctic_config, vocab):
    batch = versioned_batch(vocab)
    metrics, updated = trained(arctic_config, batch, max_staleness=1)
    by_hand = batch.replace(loss_mask=batch.loss_mask & (batch.token_policy_version >= SYNCS - 1))
    _, expected = trained(arctic_config, by_hand)
    for name, tensor in expected.items():
        assert torch.equal(updated[name], tensor), name
    stale = batch.loss_mask & (batch.token_policy_version == 0)
    assert metrics["stale_tokens_dropped"] == stale.sum() > 0
    whole_rows = (stale.sum(1) == batch.loss_mask.sum(1)) & stale.any(1)
    assert metrics["stale_samples_dropped"] == whole_rows.sum() > 0
    assert metrics["staleness_max"] == 2
    counted = SYNCS - batch.token_policy_version[batch.loss_mask]
    assert metrics["staleness_mean"] == pytest.approx(counted.float().mean().item())


def test_with_nothing_older_than_the_bound_the_batch_trains_as_given(arctic_config, vocab):
    batch = versioned_batch(vocab)
    metrics, updated = trained(arctic_config, batch, max_staleness=2)
    _, expected = trained(arctic_config, batch)
    for name, tensor in expected.items():
        assert torch.equal(updated[name], tensor), name
    assert metrics["stale_tokens_dropped"] == metrics["stale_samples_dropped"] == 0


def test_versions_are_needed_and_none_may_be_newer_than_the_servers(vocab):
    plain = random_grpo_batch(vocab)
    with pytest.raises(RequestError, match="max_staleness needs the batch's policy versions"):
        drop_stale(plain, 3, 1)
    per_sample = plain.replace(policy_version=torch.full((plain.num_responses,), 4))
    with pytest.raises(RequestError, match="tokens of policy version 4, newer than the server's 3"):
        drop_stale(per_sample, 3, 1)
    kept, metrics = drop_stale(per_sample, 6, 1)  # one version per sample: all of them 2 syncs old
    assert not kept.loss_mask.any() and metrics["stale_samples_dropped"] == plain.num_responses
