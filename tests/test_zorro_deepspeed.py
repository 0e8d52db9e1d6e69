"""ZoRRo through DeepSpeed ZeRO 0 and 3, per model family, against the plain per-sequence computation.

The engine runs with its defaults (prompt deduplication on); the expected values come from the
bare transformers model, one padded row per response, with the same loss computed by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient
from arctic_core.demo.tiny_model import TINY_SHAPES, build_tiny_model, build_tokenizer
from arctic_core.losses.processors import Entropy, LogProbs
from arctic_zorro.forward import response_outputs
from forest_batches import forest_batch, padded_batch

pytestmark = pytest.mark.slow
ENTROPY_WEIGHT = 0.1


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory) -> dict[str, Path]:
    tokenizer = build_tokenizer(["count up from 1 2 3 4 5 6 7 8 9 repeat down"] * 4)
    paths = {}
    for family in TINY_SHAPES:
        path = tmp_path_factory.mktemp(family)
        build_tiny_model(tokenizer, family=family, seed=3).save_pretrained(path)
        paths[family] = path
    return paths


def combined_batch() -> RolloutBatch:
    """Both forest shapes in one call, with advantages and a loss mask hiding one token."""
    a, b = forest_batch(), padded_batch()
    prompts = [a.prompt(i) for i in range(a.num_responses)] + [b.prompt(i) for i in range(b.num_responses)]
    responses = [a.response(i) for i in range(a.num_responses)] + [b.response(i) for i in range(b.num_responses)]
    unique = list(dict.fromkeys(map(tuple, prompts)))
    index = [unique.index(tuple(p)) for p in prompts]
    batch = RolloutBatch.from_lists([list(p) for p in unique], responses, index)
    mask = batch.loss_mask.clone()
    mask[1, 2] = False
    return batch.replace(loss_mask=mask)


def plain_loss_and_grads(path: Path, batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SFT + entropy bonus on the bare model, token-mean over the loss mask: outputs and gradients."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    outputs = response_outputs(model, batch, {"logprobs": LogProbs(), "entropy": Entropy()})
    mask = batch.loss_mask.float()
    loss = (-(outputs["logprobs"] * mask).sum() - ENTROPY_WEIGHT * (outputs["entropy"] * mask).sum()) / mask.sum()
    loss.backward()
    return outputs, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("family", sorted(TINY_SHAPES))
def test_zorro_deepspeed_matches_plain_computation(family_paths, family, stage):
    batch = combined_batch()
    expected, expected_grads = plain_loss_and_grads(family_paths[family], batch)
    config = {
        "model": {"path": str(family_paths[family]), "device": "cpu"},
        "trainer": {"backend": "deepspeed", "micro_batch_tokens": 40, "options": {"zero_stage": stage}},
        # The trainer is under test; the reference sampler runs every family (the embedded engine
        # refuses Mistral's sliding-window layers).
        "sampler": {"backend": "hf-generate"},
    }
    with ArcticClient.in_process(config) as client:
        trainer = client.transport.server.trainer
        assert trainer.options.zorro.enable  # on by default
        got = client.log_probs(batch, processors=["logprobs", "entropy"]).outputs
        for name in ("logprobs", "entropy"):
            torch.testing.assert_close(got[name], expected[name].detach(), atol=1e-5, rtol=0, msg=name)
        client.fwd_bwd(batch, ["sft", {"name": "entropy", "weight": ENTROPY_WEIGHT}])
        grads = trainer.full_gradients()
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert (grad - expected_grads[name]).norm() <= 1e-4 * expected_grads[name].norm(), name
