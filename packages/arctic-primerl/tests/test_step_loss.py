"""One training step of PRIME-RL's rollout file, through ``RolloutTrainer.train_step`` and the
embedded Arctic server, gives the gradient of PRIME-RL's loss over that whole step.

The step is ``fixtures/rollouts_rank_0.bin``, the file PRIME-RL's own code wrote
(``fixtures/record_fixtures.py``): samples at two temperatures (13 trainable tokens at 1.0, 10 at
0.7), responses of different lengths, environment tokens masked inside a multi-turn sample, a
zero-advantage sample of rl weight 0 and padding. Arctic trains it in one ``fwd_bwd`` call per
temperature; PRIME-RL sums every token's loss over the step and divides by the step's trainable
tokens, whichever temperature they were sampled at. The reference here is that definition in
plain torch, on the tiny policy loaded with transformers, one sample at a time.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_primerl.config import read_run
from arctic_primerl.service import ArcticPrimeRL
from arctic_primerl.wire import decode
from runs import FIXTURES, write_toml

ROLLOUTS = (FIXTURES / "rollouts_rank_0.bin").read_bytes()
SAMPLES = json.loads((FIXTURES / "samples.json").read_text())
"""The samples PRIME-RL packed into ``ROLLOUTS``, as its orchestrator built them."""
PARITY = json.loads((FIXTURES / "loss_parity.json").read_text())
DEFAULT_CASES = [case for case in PARITY["cases"] if case["config"]["type"] == "default"]
PRIME_RL_DEFAULT = {"dppo_mask_low": 0.2, "dppo_mask_high": 0.2, "adv_tau": 1.0, "kl_tau": 1e-3}
"""PRIME-RL's ``DefaultLossConfig()``: the loss a run without a ``[trainer.loss]`` table trains."""


def prime_rl_token_losses(trainer_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                          advantages: torch.Tensor, rl_mask: torch.Tensor, config: dict) -> torch.Tensor:
    """PRIME-RL's default loss of each token before the step's normalisation (its ``default_loss_fn``:
    DPPO-Binary TV with Kimi K2.5's KL). A token whose probability moved past the trust region in
    its advantage's direction drops out of the policy-gradient term; every trainable token keeps
    the KL term. Tokens outside ``rl_mask`` contribute 0."""
    log_ratio = trainer_logprobs - inference_logprobs
    probs_diff = trainer_logprobs.exp() - inference_logprobs.exp()
    outside = torch.where(advantages > 0, probs_diff > config["dppo_mask_high"], probs_diff < -config["dppo_mask_low"])
    keep = rl_mask & ~outside
    policy_gradient = keep * config["adv_tau"] * advantages * log_ratio.exp()
    return torch.where(rl_mask, -policy_gradient + config["kl_tau"] * log_ratio**2, torch.zeros_like(log_ratio))


def rl_mask_of(mask: list[bool], rl_weights: list[float] | None) -> torch.Tensor:
    """PRIME-RL's trainable tokens: the loss mask, less tokens of rl weight 0."""
    weights = rl_weights if rl_weights is not None else [1.0] * len(mask)
    return torch.tensor([m and w != 0.0 for m, w in zip(mask, weights, strict=True)])


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: f"kl{c['config']['kl_tau']}")
def test_the_reference_loss_is_the_one_prime_rl_recorded(case):
    """The reference below is PRIME-RL's: on the trainer log-probs ``record_fixtures.py`` drew for
    each packed token, token losses summed over the step's rows over the step's trainable tokens
    give the loss and gradients PRIME-RL's ``compute_loss`` recorded."""
    total = torch.zeros((), dtype=torch.float64)
    leaves = []
    for row, recorded in zip(decode(ROLLOUTS), case["trainer_logprobs"], strict=True):
        leaves.append(logprobs := torch.tensor(recorded, dtype=torch.float64, requires_grad=True))
        total = total + prime_rl_token_losses(
            logprobs, torch.tensor(row.inference_logprobs, dtype=torch.float64),
            torch.tensor(row.advantages, dtype=torch.float64), rl_mask_of(row.loss_mask, row.rl_weights),
            case["config"]).sum()
    loss = total / case["rl_scale"]
    assert loss.item() == pytest.approx(case["loss"], abs=1e-6)
    loss.backward()
    for mine, theirs in zip(leaves, case["grads"], strict=True):
        assert torch.allclose(mine.grad, torch.tensor(theirs, dtype=torch.float64), atol=1e-6, rtol=1e-4)


def prime_rl_step_loss(model: torch.nn.Module, samples: list[dict], config: dict) -> tuple[torch.Tensor, int]:
    """PRIME-RL's loss of one step: every sample's token losses (its log-probs taken with the logits
    divided by its sampling temperature), summed over the whole step and divided once by the
    step's count of trainable tokens. Returns the loss and that count."""
    total, count = torch.zeros(()), 0
    for sample in samples:
        ids = torch.tensor([sample["token_ids"]])
        logits = model(input_ids=ids).logits[0, :-1] / sample["temperatures"][0]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # token t from t-1
        rl_mask = rl_mask_of(sample["mask"], sample["rl_weights"])[1:]
        total = total + prime_rl_token_losses(logprobs, torch.tensor(sample["logprobs"][1:]),
                                              torch.tensor(sample["advantages"][1:]), rl_mask, config).sum()
        count += int(rl_mask.sum())
    return total / count, count


def test_a_step_at_two_temperatures_has_the_gradient_of_prime_rls_loss_over_the_whole_step(tmp_path, policy):
    """``train_step`` on PRIME-RL's rollout file: the gradient the optimizer step receives, its
    norm and the loss reported are those of PRIME-RL's loss of the step, in which each
    temperature's tokens count over all of the step's trainable tokens (fp32 on the CPU: loss to
    1e-5, each parameter's gradient to 1e-4, relative)."""
    per_temperature = Counter()
    for sample in SAMPLES:
        per_temperature[sample["temperatures"][0]] += int(rl_mask_of(sample["mask"], sample["rl_weights"]).sum())
    assert per_temperature == {1.0: 13, 0.7: 10}  # two calls of different sizes: a per-call scale shows

    run = read_run(write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", steps=1))  # PRIME-RL's default loss
    service = ArcticPrimeRL(run, on_gpu=False)
    try:
        engine = service.client.transport.server.trainer
        received: dict[str, torch.Tensor] = {}
        optimizer_step = engine.optimizer_step

        def recording_step(lr=None):
            received.update(engine.full_gradients())  # what the step applies, before clipping
            return optimizer_step(lr=lr)

        engine.optimizer_step = recording_step
        metrics = service.trainer.train_step(ROLLOUTS, "rollouts/step_1/rank_0.bin")
    finally:
        service.stop()

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)  # the step's starting weights
    loss, count = prime_rl_step_loss(model, SAMPLES, PRIME_RL_DEFAULT)
    loss.backward()
    want = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    assert metrics["trainable_tokens"] == count == 23 and metrics["samples"] == 5
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert sorted(received) == sorted(want)
    errors = {name: float((received[name] - grad).norm() / grad.norm()) for name, grad in want.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-4, f"{worst}: gradient off by {errors[worst]:.3g} of its norm"
    norm = torch.cat([grad.flatten() for grad in want.values()]).norm().item()
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
