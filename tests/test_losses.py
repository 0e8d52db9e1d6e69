"""Loss terms, aggregation and processors checked against values computed by hand.

Conventions used throughout:
- per-token tensors are float64 so that comparisons can be tight; the old / reference log-probs
  are dyadic numbers (-1.0, -0.5, ...), exact in float32, because the loss terms read them through
  ``.float()``;
- current log-probs are built as ``old + log(ratio)`` so every importance ratio is a chosen number;
- expected values are literal numbers (arithmetic in the comments) or plain ``math`` on scalars.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from arctic_core.batch import RolloutBatch
from arctic_core.config import LossTermConfig
from arctic_core.errors import BatchError, ConfigError, PluginNotFoundError, RequestError
from arctic_core.plugins.interfaces import LossContext
from arctic_core.losses.policy import CISPOLoss, GSPOLoss, PolicyGradientLoss, PPOLoss, SAPOLoss, VESPOLoss
from arctic_core.losses.regularizers import EntropyBonus, KLLoss, SFTLoss
from arctic_core.losses.objective import build_objective
from arctic_core.losses.processors import Entropy, LogProbs
from arctic_core.plugins.registry import default_registry

F64 = torch.float64
TOL = 1e-9
MTOL = 1e-6  # fraction metrics (clipfrac, ...) are float32: clipped.float()


# --------------------------------------------------------------------------- helpers
def pad(rows: list[list[float]], width: int, fill: float = 0.0) -> list[list[float]]:
    return [list(r) + [fill] * (width - len(r)) for r in rows]


def make_batch(lens: list[int], **fields: object) -> RolloutBatch:
    """One prompt answered ``len(lens)`` times; list-of-rows fields are right-padded to float64."""
    width = max(lens)
    responses = [[10 + j for j in range(n)] for n in lens]
    tensors: dict[str, torch.Tensor] = {}
    for name, value in fields.items():
        if name == "advantages" and not isinstance(value[0], list):
            tensors[name] = torch.tensor(value, dtype=F64)
        elif name == "loss_mask":
            tensors[name] = torch.tensor(pad(value, width, False), dtype=torch.bool)
        else:
            tensors[name] = torch.tensor(pad(value, width), dtype=F64)
    return RolloutBatch.from_lists([[1, 2]], responses, [0] * len(lens), **tensors)


def logprobs_from(base: list[list[float]], log_ratios: list[list[float]]) -> torch.Tensor:
    """Leaf float64 tensor ``base + log_ratio`` (padding: the base value), with grad."""
    width = max(len(r) for r in base)
    rows = [[b + d for b, d in zip(brow, drow, strict=True)] for brow, drow in zip(base, log_ratios, strict=True)]
    return torch.tensor(pad(rows, width), dtype=F64, requires_grad=True)


def grad_of(loss: torch.Tensor, logp: torch.Tensor) -> list[list[float]]:
    loss.backward()
    return logp.grad.tolist()


def assert_rows(actual: list[list[float]], expected: list[list[float]], tol: float = TOL) -> None:
    assert len(actual) == len(expected)
    for a_row, e_row in zip(actual, expected, strict=True):
        assert a_row == pytest.approx(e_row, abs=tol)


# --------------------------------------------------------------------------- the PPO batch
# Two responses of lengths 3 and 2 (width 3), clip_low = 0.2, clip_high = 0.28 (range [0.8, 1.28]).
#   row 0, A = +1, ratios 1.25, 1.5, 0.5
#     1.25: inside [0.8, 1.28] (it would be clipped with a symmetric 0.2)  loss -1.25
#     1.5 : above 1.28, clipped at 1+clip_high                            loss -1.28  (clipped)
#     0.5 : A > 0 keeps the smaller objective, min(0.5, 0.8)*A            loss -0.5
#   row 1, A = -2, ratios 0.5, 1.1
#     0.5 : below 0.8, clipped at 1-clip_low: max(2*0.5, 2*0.8)           loss  1.6   (clipped)
#     1.1 : inside                                                        loss  2.2
# sums: row 0 = -3.03, row 1 = 3.8, all = 0.77; tokens 5, clipped 2.
PPO_OLD = [[-1.0, -0.5, -2.0], [-1.5, -1.75]]
PPO_RATIOS = [[1.25, 1.5, 0.5], [0.5, 1.1]]
PPO_ADV = [1.0, -2.0]
PPO_OPTS = {"clip_low": 0.2, "clip_high": 0.28}


def ppo_case(**extra: object) -> tuple[RolloutBatch, torch.Tensor]:
    batch = make_batch([3, 2], old_logprobs=PPO_OLD, advantages=PPO_ADV, **extra)
    logp = logprobs_from(PPO_OLD, [[math.log(r) for r in row] for row in PPO_RATIOS])
    return batch, logp


def test_ppo_token_mean_value_clipfrac_and_gradient() -> None:
    batch, logp = ppo_case()
    loss, metrics = PPOLoss(**PPO_OPTS)({"logprobs": logp}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx(0.154, abs=TOL)  # 0.77 / 5
    assert metrics["clipfrac"] == pytest.approx(0.4, abs=MTOL)  # 2 of 5 tokens
    # ratio 1.5 with A > 0 (above 1.28) and ratio 0.5 with A < 0 (below 0.8); 0.5 with A > 0 is not clipped
    assert metrics["clip_high_frac"] == pytest.approx(0.2, abs=MTOL)
    assert metrics["clip_low_frac"] == pytest.approx(0.2, abs=MTOL)
    assert metrics["dual_clipfrac"] == 0.0
    # approx_kl = token-mean of 0.5 * log(ratio)^2
    logs = [math.log(r) for row in PPO_RATIOS for r in row]
    assert metrics["approx_kl"] == pytest.approx(sum(0.5 * x * x for x in logs) / 5, abs=TOL)
    # d(-A r)/d logp = -A r; clipped tokens and padding get 0; token-mean divides by 5.
    #   row 0: -1.25/5 = -0.25, 0, -0.5/5 = -0.1     row 1: 0, 2*1.1/5 = 0.44, (pad) 0
    assert_rows(grad_of(loss, logp), [[-0.25, 0.0, -0.1], [0.0, 0.44, 0.0]])


def test_ppo_on_policy_uses_the_current_logprobs_detached() -> None:
    """old_logprobs: current (TRL / verl without re-use): ratio 1, gradient -A / n per token."""
    batch, logp = ppo_case()
    batch = batch.replace(old_logprobs=None)
    loss, metrics = PPOLoss(**PPO_OPTS, old_logprobs="current")({"logprobs": logp}, batch, LossContext.of(batch))
    adv = [a for a, n in zip(PPO_ADV, [3, 2], strict=True) for _ in range(n)]
    assert loss.item() == pytest.approx(-sum(adv) / 5, abs=TOL)
    assert metrics["clipfrac"] == 0.0
    assert_rows(grad_of(loss, logp), [[-PPO_ADV[0] / 5] * 3, [-PPO_ADV[1] / 5] * 2 + [0.0]])
    with pytest.raises(BatchError, match="needs batch.old_logprobs"):
        PPOLoss(**PPO_OPTS)({"logprobs": logp}, batch, LossContext.of(batch))


def test_ppo_symmetric_clip_when_clip_high_is_unset() -> None:
    # clip_high defaults to clip_low = 0.2: ratio 1.25 (A=+1) is now clipped at 1.2 -> -1.2.
    # sum = -1.2 - 1.2 - 0.5 + 1.6 + 2.2 = 0.9 -> 0.18; clipped tokens 3 of 5.
    batch, logp = ppo_case()
    loss, metrics = PPOLoss(clip_low=0.2)({"logprobs": logp}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx(0.18, abs=TOL)
    assert metrics["clipfrac"] == pytest.approx(0.6, abs=MTOL)


def test_ppo_dual_clip_caps_negative_advantage_loss() -> None:
    # One response of length 2, A = -1, c = 3, ratios 10 and 1.1.
    #   ratio 10: ordinary clipped loss max(10, 1.28) = 10 > c*|A| = 3 -> capped at 3, no gradient
    #   ratio 1.1: loss 1.1, gradient -A r / 2 = 0.55
    # loss = (3 + 1.1) / 2 = 2.05; dual_clipfrac = 1/2; clipfrac 0 (10 is the unclipped branch).
    old = [[-1.0, -0.5]]
    batch = make_batch([2], old_logprobs=old, advantages=[-1.0])
    logp = logprobs_from(old, [[math.log(10.0), math.log(1.1)]])
    term = PPOLoss(**PPO_OPTS, dual_clip=3.0)
    loss, metrics = term({"logprobs": logp}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx(2.05, abs=TOL)
    assert metrics["dual_clipfrac"] == pytest.approx(0.5, abs=MTOL)
    assert metrics["clipfrac"] == 0.0
    assert_rows(grad_of(loss, logp), [[0.0, 0.55]])


def test_ppo_dual_clip_leaves_positive_advantages_alone() -> None:
    # A = +1, ratio 10: clipped at 1.28 -> loss -1.28 whatever c is.
    old = [[-1.0]]
    batch = make_batch([1], old_logprobs=old, advantages=[1.0])
    logp = logprobs_from(old, [[math.log(10.0)]])
    loss, metrics = PPOLoss(**PPO_OPTS, dual_clip=3.0)({"logprobs": logp}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx(-1.28, abs=TOL)
    assert metrics["dual_clipfrac"] == 0.0


@pytest.mark.parametrize(
    ("aggregation", "ctx", "expected"),
    [
        # -3.03 + 3.8, no normaliser
        ("token-sum", LossContext(5, 2, 3), 0.77),
        # (row0 sum / 3 + row1 sum / 2) / 2 = (-1.01 + 1.9) / 2
        ("seq-mean-token-mean", LossContext(5, 2, 3), 0.445),
        # (-3.03 + 3.8) / 2
        ("seq-mean-token-sum", LossContext(5, 2, 3), 0.385),
        # 0.77 / (2 sequences * constant length 4)
        ("seq-mean-token-sum-norm", LossContext(5, 2, 4), 0.09625),
    ],
)
def test_ppo_aggregation_modes(aggregation: str, ctx: LossContext, expected: float) -> None:
    batch, logp = ppo_case()
    loss, _ = PPOLoss(**PPO_OPTS, aggregation=aggregation)({"logprobs": logp}, batch, ctx)
    assert loss.item() == pytest.approx(expected, abs=TOL)


def test_loss_context_of_counts_mask_tokens_and_takes_max_len() -> None:
    batch, _ = ppo_case(loss_mask=[[True, False, True], [True, True]])
    assert LossContext.of(batch) == LossContext(num_tokens=4, num_sequences=2, max_response_len=3)
    assert LossContext.of(batch, max_response_len=4).max_response_len == 4


def test_ppo_loss_mask_excludes_tokens() -> None:
    # Mask out row 1's ratio-1.1 token (loss 2.2). Its log-prob is set to something absurd to show
    # that it cannot leak in. sum = -1.25 - 1.28 - 0.5 + 1.6 = -1.43 over 4 tokens.
    batch, logp = ppo_case(loss_mask=[[True, True, True], [True, False]])
    with torch.no_grad():
        logp[1, 1] = 50.0
    ctx = LossContext.of(batch)
    assert ctx.num_tokens == 4
    loss, metrics = PPOLoss(**PPO_OPTS)({"logprobs": logp}, batch, ctx)
    assert loss.item() == pytest.approx(-0.3575, abs=TOL)  # -1.43 / 4
    assert metrics["clipfrac"] == pytest.approx(0.5, abs=MTOL)  # 2 of 4
    # grads now / 4: -1.25/4, 0, -0.5/4; masked and clipped tokens 0
    assert_rows(grad_of(loss, logp), [[-0.3125, 0.0, -0.125], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("aggregation", "part0", "part1"),
    [
        ("token-mean", -0.606, 0.76),  # -3.03/5, 3.8/5
        ("token-sum", -3.03, 3.8),
        ("seq-mean-token-mean", -0.505, 0.95),  # (-3.03/3)/2, (3.8/2)/2
        ("seq-mean-token-sum", -1.515, 1.9),  # -3.03/2, 3.8/2
        ("seq-mean-token-sum-norm", -0.505, 0.6333333333333333),  # -3.03/(2*3), 3.8/(2*3)
    ],
)
def test_ppo_micro_batches_add_up_to_full_batch(aggregation: str, part0: float, part1: float) -> None:
    batch, logp = ppo_case()
    ctx = LossContext.of(batch)  # normalisers of the whole call, shared by both micro-batches
    term = PPOLoss(**PPO_OPTS, aggregation=aggregation)
    full, full_metrics = term({"logprobs": logp}, batch, ctx)
    mb0, m0 = term({"logprobs": logp[0:1, :3]}, batch.select([0]), ctx)
    mb1, m1 = term({"logprobs": logp[1:2, :2]}, batch.select([1]), ctx)  # select trims width to 2
    assert mb0.item() == pytest.approx(part0, abs=TOL)
    assert mb1.item() == pytest.approx(part1, abs=TOL)
    assert mb0.item() + mb1.item() == pytest.approx(full.item(), abs=TOL)
    # 1/5 + 1/5
    assert float(m0["clipfrac"] + m1["clipfrac"]) == pytest.approx(float(full_metrics["clipfrac"]), abs=MTOL)


# --------------------------------------------------------------------------- GSPO
# Three responses (lengths 3, 2, 2); defaults clip_low = 3e-4, clip_high = 4e-4,
# i.e. the sequence ratio s is clipped to [0.9997, 1.0004].
#   row 0, A = +1, log-ratios 2e-4, -1e-4, 2e-4: mean 1e-4, s0 = exp(1e-4) = 1.000100005 (inside)
#       per-sequence loss -s0
#   row 1, A = +2, log-ratios 0.01, 0.03: mean 0.02, s1 = exp(0.02) = 1.0202 > 1.0004
#       clipped: -2 * 1.0004 = -2.0008
#   row 2, A = -1, log-ratios -0.02, 0: mean -0.01, s2 = exp(-0.01) = 0.99005 < 0.9997
#       clipped: max(0.99005, 0.9997) = 0.9997
GSPO_OLD = [[-1.0, -0.5, -2.0], [-1.5, -0.25], [-0.75, -1.25]]
GSPO_LOG_RATIOS = [[2e-4, -1e-4, 2e-4], [0.01, 0.03], [-0.02, 0.0]]
GSPO_ADV = [1.0, 2.0, -1.0]
S0, S1, S2 = math.exp(1e-4), math.exp(0.02), math.exp(-0.01)


def gspo_case() -> tuple[RolloutBatch, torch.Tensor]:
    batch = make_batch([3, 2, 2], old_logprobs=GSPO_OLD, advantages=GSPO_ADV)
    return batch, logprobs_from(GSPO_OLD, GSPO_LOG_RATIOS)


def test_gspo_value_unclipped_and_clipped_sequences() -> None:
    batch, logp = gspo_case()
    ctx = LossContext.of(batch)
    term = GSPOLoss()
    loss, metrics = term({"logprobs": logp}, batch, ctx)
    # (-s0 - 2.0008 + 0.9997) / 3 sequences
    assert loss.item() == pytest.approx((-S0 - 2.0008 + 0.9997) / 3, abs=TOL)
    assert loss.item() == pytest.approx(-0.66706666833, abs=1e-9)
    assert metrics["clipfrac"] == pytest.approx(4 / 7, abs=MTOL)  # rows 1 and 2: 4 of 7 tokens
    assert metrics["seq_ratio_mean"] == pytest.approx((S0 + S1 + S2) / 3, abs=TOL)
    # the unclipped sequence on its own (same ctx): -s0 / 3
    alone, _ = term({"logprobs": logp[0:1, :3]}, batch.select([0]), ctx)
    assert alone.item() == pytest.approx(-1.000100005 / 3, abs=1e-9)


def test_gspo_gradient_is_sequence_level() -> None:
    batch, logp = gspo_case()
    loss, _ = GSPOLoss()({"logprobs": logp}, batch, LossContext.of(batch))
    # unclipped row 0: every token gets -A * s0 / |y_0| / num_sequences = -s0 / 3 / 3,
    # the same for all three tokens although their own ratios differ; clipped rows: 0.
    g = -S0 / 9
    assert_rows(grad_of(loss, logp), [[g, g, g], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- KL
# ref log-probs dyadic, logp = ref - d, so ref - logp = d, per token:
#   d = 0.5, 1.0, -1.0 (row 0) and 2.0, 0.25 (row 1); 5 tokens
KL_REF = [[-1.0, -0.5, -2.0], [-1.5, -0.25]]
KL_D = [[0.5, 1.0, -1.0], [2.0, 0.25]]
D = [d for row in KL_D for d in row]


def kl_case() -> tuple[RolloutBatch, torch.Tensor]:
    batch = make_batch([3, 2], ref_logprobs=KL_REF)
    return batch, logprobs_from(KL_REF, [[-d for d in row] for row in KL_D])


def k3(d: float) -> float:
    return math.exp(d) - d - 1.0


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", -0.55),  # mean(logp - ref) = -(0.5 + 1 - 1 + 2 + 0.25) / 5 = -2.75 / 5
        ("k2", 0.63125),  # mean(d^2 / 2) = (0.25 + 1 + 1 + 4 + 0.0625) / 2 / 5
        ("k3", sum(k3(d) for d in D) / 5),  # e^d - d - 1: 0.14872 + 0.71828 + 0.36788 + 4.38906 + 0.03403
    ],
)
def test_kl_estimators_token_mean(estimator: str, expected: float) -> None:
    batch, logp = kl_case()
    loss, metrics = KLLoss(estimator=estimator)({"logprobs": logp}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx(expected, abs=TOL)
    assert metrics["kl"] == pytest.approx(expected, abs=TOL)


def test_kl_k3_value_literal_and_gradient() -> None:
    batch, logp = kl_case()
    loss, _ = KLLoss()({"logprobs": logp}, batch, LossContext.of(batch))  # default: k3, clamp 10
    assert loss.item() == pytest.approx(5.6579640561 / 5, abs=1e-9)
    # d k3 / d logp = 1 - exp(ref - logp) = 1 - e^d, divided by 5 tokens; padding 0
    expected = [[(1 - math.exp(d)) / 5 for d in row] for row in KL_D]
    assert_rows(grad_of(loss, logp), pad(expected, 3))
    # e.g. d = 1: (1 - e) / 5 = -0.343656...
    assert logp.grad[0, 1].item() == pytest.approx(-0.3436563656918, abs=1e-12)


def test_kl_clamp_engages() -> None:
    # clamp = 1: only d = 2 exceeds it (k3 = e^2 - 3 = 4.389) -> 1.0, and its gradient vanishes.
    batch, logp = kl_case()
    loss, metrics = KLLoss(estimator="k3", clamp=1.0)({"logprobs": logp}, batch, LossContext.of(batch))
    expected = (k3(0.5) + k3(1.0) + k3(-1.0) + 1.0 + k3(0.25)) / 5
    assert loss.item() == pytest.approx(expected, abs=TOL)
    assert metrics["kl"] == pytest.approx(expected, abs=TOL)
    grad = grad_of(loss, logp)
    assert grad[1][0] == 0.0
    assert grad[0][0] == pytest.approx((1 - math.exp(0.5)) / 5, abs=TOL)


def test_kl_default_clamp_is_ten() -> None:
    # d = 5: k3 = e^5 - 6 = 142.41 -> clamped to 10; k1 = -5 stays (|k1| < 10).
    ref = [[-1.0]]
    batch = make_batch([1], ref_logprobs=ref)
    logp = logprobs_from(ref, [[-5.0]])
    ctx = LossContext.of(batch)
    assert KLLoss(estimator="k3")({"logprobs": logp}, batch, ctx)[0].item() == pytest.approx(10.0, abs=TOL)
    assert KLLoss(estimator="k1")({"logprobs": logp}, batch, ctx)[0].item() == pytest.approx(-5.0, abs=TOL)
    assert KLLoss(estimator="k3", clamp=None)({"logprobs": logp}, batch, ctx)[0].item() == pytest.approx(
        math.exp(5) - 6, abs=1e-9
    )


# --------------------------------------------------------------------------- entropy, SFT
def test_entropy_bonus_value_and_gradient() -> None:
    batch = make_batch([3, 2])
    entropy = torch.tensor([[0.5, 1.0, 1.5], [2.0, 0.25, 9.0]], dtype=F64, requires_grad=True)  # 9.0: padding
    loss, metrics = EntropyBonus()({"entropy": entropy}, batch, LossContext.of(batch))
    # -(0.5 + 1 + 1.5 + 2 + 0.25) / 5 = -5.25 / 5
    assert loss.item() == pytest.approx(-1.05, abs=TOL)
    assert metrics["entropy"] == pytest.approx(1.05, abs=TOL)
    assert_rows(grad_of(loss, entropy), [[-0.2, -0.2, -0.2], [-0.2, -0.2, 0.0]])


def test_sft_is_token_mean_nll() -> None:
    batch = make_batch([3, 2])
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.25, -3.0, -7.0]], dtype=F64, requires_grad=True)  # -7: padding
    loss, metrics = SFTLoss()({"logprobs": logp}, batch, LossContext.of(batch))
    # (1 + 0.5 + 2 + 0.25 + 3) / 5 = 6.75 / 5
    assert loss.item() == pytest.approx(1.35, abs=TOL)
    assert metrics["nll"] == pytest.approx(1.35, abs=TOL)
    assert_rows(grad_of(loss, logp), [[-0.2, -0.2, -0.2], [-0.2, -0.2, 0.0]])


# --------------------------------------------------------------------------- processors
# logits [0, ln 2]:
#   T = 1: probs [1/3, 2/3]; H = ln 3 - (2/3) ln 2 = 0.636514168...
#   T = 2: z = [0, ln(sqrt 2)], probs [1/(1+sqrt2), sqrt2/(1+sqrt2)];
#          H = ln(1 + sqrt2) - sqrt2/(1+sqrt2) * ln(sqrt2)
R2 = math.sqrt(2.0)


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [
        (1.0, math.log(3) - 2 / 3 * math.log(2)),
        (2.0, math.log(1 + R2) - R2 / (1 + R2) * math.log(R2)),
    ],
)
def test_entropy_processor(temperature: float, expected: float) -> None:
    logits = torch.tensor([[0.0, math.log(2.0)]])
    out = Entropy(temperature=temperature)(logits, torch.tensor([1]))
    assert out["entropy"].shape == (1,)
    assert out["entropy"].item() == pytest.approx(expected, abs=1e-6)


def test_entropy_processor_keeps_gradient() -> None:
    # T = 1: dH/dz_j = -p_j (z_j - E_p[z]), E_p[z] = (2/3) ln 2
    #   z_0: -(1/3)(0 - (2/3) ln2) = (2/9) ln 2;  z_1: -(2/3)(ln2 - (2/3) ln2) = -(2/9) ln 2
    logits = torch.tensor([[0.0, math.log(2.0)]], requires_grad=True)
    Entropy()(logits, torch.tensor([0]))["entropy"].sum().backward()
    assert logits.grad[0].tolist() == pytest.approx([2 / 9 * math.log(2), -2 / 9 * math.log(2)], abs=1e-6)


@pytest.mark.parametrize(
    ("temperature", "target", "expected"),
    [
        (1.0, 1, math.log(2 / 3)),
        (1.0, 0, math.log(1 / 3)),
        (2.0, 1, math.log(R2 / (1 + R2))),
        (2.0, 0, math.log(1 / (1 + R2))),
    ],
)
def test_logprobs_processor(temperature: float, target: int, expected: float) -> None:
    logits = torch.tensor([[0.0, math.log(2.0)]])
    out = LogProbs(temperature=temperature)(logits, torch.tensor([target]))
    assert out["logprobs"].item() == pytest.approx(expected, abs=1e-6)


FP64_STATS = """
import torch

def fp64_stats(z, targets):
    \"\"\"The processors' expressions in fp64 on scaled logits ``z``: (log-probs of ``targets``, entropy).\"\"\"
    lse = torch.logsumexp(z, -1)
    return z.gather(-1, targets[:, None])[:, 0] - lse, lse - (torch.softmax(z, -1) * z).sum(-1)
"""


TOKEN_STATS_CHECK = FP64_STATS + """
from arctic_core.losses.token_stats import token_stats

gen = torch.Generator().manual_seed(0)
for dtype, grad_rtol in ((torch.float32, 1e-4), (torch.bfloat16, 8e-3)):  # bf16: the gradient rounded once
    for temperature in (1.0, 0.7):
        # one block with a masked tail; several blocks; rows of a wider tensor (row stride != V); no rows
        for rows, vocab, width in ((7, 1000, 1000), (5, 9000, 9000), (3, 5000, 5003), (0, 100, 100)):
            wide = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
            targets = torch.randint(0, vocab, (rows,), generator=gen)
            expected = fp64_stats(wide[:, :vocab].double() / temperature, targets)
            weights = [torch.randn(rows, generator=gen, dtype=torch.float64) for _ in range(2)]
            for used in ((0,), (1,), (0, 1)):  # a loss reading the log-probs, the entropy, both
                reference = wide.double().requires_grad_()
                logits = wide.clone().requires_grad_()
                ref = fp64_stats(reference[:, :vocab] / temperature, targets)
                got = token_stats(logits[:, :vocab], targets, temperature)
                for i in range(2):
                    assert got[i].dtype == torch.float32 and got[i].shape == (rows,)
                    torch.testing.assert_close(got[i].double(), expected[i], atol=1e-5, rtol=0)
                sum(got[i].double() @ weights[i] for i in used).backward()
                sum(ref[i] @ weights[i] for i in used).backward()
                assert logits.grad.dtype == dtype and logits.grad.shape == wide.shape
                if rows:
                    error = (logits.grad.double() - reference.grad).abs().max() / reference.grad.abs().max()
                    assert error <= grad_rtol, (dtype, temperature, rows, vocab, used, float(error))
try:
    token_stats(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long), 1.0)
    raise AssertionError("targets of another length were taken")
except ValueError as error:
    assert "logits [N, V] and targets [N], got (2, 5) and (3,)" in str(error), error
print("ok")
"""


def test_the_processor_kernels_equal_the_expressions_in_fp64() -> None:
    """On a GPU the processors run one Triton kernel each way (``token_stats``); here through
    Triton's interpreter on the CPU: log-probs and entropy within 1e-5 of the expressions in fp64
    (the eager fp32 entropy, ``lse - sum p z``, is off by up to ~6e-5 at these logits), gradients
    through either output or both within 1e-4 of fp64's in fp32 (bf16: one rounding)."""
    run = subprocess.run([sys.executable, "-c", TOKEN_STATS_CHECK], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


SHARED_KERNEL_CHECK = FP64_STATS + """
from arctic_core.losses import processors, token_stats
from arctic_zorro.forward import run_processors

processors.runs_on_kernel = lambda logits: True  # the GPU's dispatch, with the kernels interpreted on the CPU
launches = {"forward": 0, "backward": 0}
for name in launches:
    kernel = getattr(token_stats, f"_{name}_kernel")
    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name
        def __getitem__(self, grid):
            launches[self.name] += 1
            return self.kernel[grid]
    setattr(token_stats, f"_{name}_kernel", Counted(kernel, name))

gen = torch.Generator().manual_seed(0)
wide = 3 * torch.randn(6, 5000, generator=gen)
targets = torch.randint(0, 5000, (6,), generator=gen)
weights = torch.randn(2, 6, generator=gen)
both = {"logprobs": processors.LogProbs(0.7), "entropy": processors.Entropy(0.7)}
logits = wide.clone().requires_grad_()
out = run_processors(logits, targets, both)
assert launches == {"forward": 1, "backward": 0}, launches
(out["logprobs"] @ weights[0] + out["entropy"] @ weights[1]).backward()
assert launches == {"forward": 1, "backward": 1}, launches
reference = wide.double().requires_grad_()
expected = fp64_stats(reference / 0.7, targets)
(expected[0] @ weights[0].double() + expected[1] @ weights[1].double()).backward()
torch.testing.assert_close(out["logprobs"].double(), expected[0], atol=1e-5, rtol=0)
torch.testing.assert_close(out["entropy"].double(), expected[1], atol=1e-5, rtol=0)
torch.testing.assert_close(logits.grad.double(), reference.grad, atol=1e-6, rtol=1e-4)
# outside the processor loop, and once it has returned, nothing is remembered
both["logprobs"](logits, targets), both["entropy"](logits, targets)
run_processors(logits, targets, both)
assert launches["forward"] == 4, launches
# logits written in place between two processors get statistics of their own
scaled = wide.clone()
with processors.sharing():
    both["logprobs"](scaled, targets)
    scaled.mul_(2)
    twice = both["entropy"](scaled, targets)["entropy"]
assert launches["forward"] == 6, launches
torch.testing.assert_close(twice.double(), fp64_stats(2 * wide.double() / 0.7, targets)[1], atol=1e-5, rtol=0)

# Through the LM head in chunks of 5 rows (3 chunks), its logits kept or each chunk recomputed in the
# backward: one forward launch per chunk (two when recomputed), one backward launch per chunk.
from arctic_zorro import packed_forward
head = torch.nn.Linear(16, 5000, bias=False)
hidden, head_targets = torch.randn(12, 16, generator=gen), torch.randint(0, 5000, (12,), generator=gen)
w = torch.randn(2, 12, generator=gen, dtype=torch.float64)
h64, weight64 = hidden.double().requires_grad_(), head.weight.detach().double().requires_grad_()
expected = fp64_stats((h64 @ weight64.T) / 0.7, head_targets)
(expected[0] @ w[0] + expected[1] @ w[1]).backward()
for keep in (True, False):
    packed_forward.logits_fit = lambda *args, keep=keep: keep
    launches.update(forward=0, backward=0)
    head.zero_grad(set_to_none=True)
    h = hidden.clone().requires_grad_()
    out = packed_forward.head_outputs(head, h, head_targets, both, 5)
    (out["logprobs"].double() @ w[0] + out["entropy"].double() @ w[1]).backward()
    assert launches == {"forward": 3 if keep else 6, "backward": 3}, (keep, launches)
    torch.testing.assert_close(out["logprobs"].double(), expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), expected[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(head.weight.grad.double(), weight64.grad, atol=1e-6, rtol=1e-4)
print("ok")
"""


@pytest.mark.slow
def test_log_probs_and_entropy_share_one_kernel_launch_each_way() -> None:
    """A loss reading both outputs (TRL's default, an entropy bonus) gets them from one forward
    launch and one backward launch on the same logits, with the values and gradients of the
    expressions in fp64; the sharing ends with the engine's processor loop. The same through the
    LM head's chunks, kept or recomputed in the backward."""
    run = subprocess.run([sys.executable, "-c", SHARED_KERNEL_CHECK], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


def test_a_temperature_of_zero_is_refused_when_the_processor_is_built() -> None:
    with pytest.raises(RequestError, match="processor temperature must be > 0, got 0"):
        LogProbs(temperature=0)


# --------------------------------------------------------------------------- errors
def test_ppo_without_old_logprobs_raises_batch_error() -> None:
    batch = make_batch([3, 2], advantages=PPO_ADV)
    logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    with pytest.raises(BatchError, match="old_logprobs"):
        PPOLoss()({"logprobs": logp}, batch, LossContext.of(batch))
    with pytest.raises(BatchError, match="old_logprobs"):
        GSPOLoss()({"logprobs": logp}, batch, LossContext.of(batch))


def test_kl_without_ref_logprobs_raises_batch_error() -> None:
    batch = make_batch([3, 2])
    logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    with pytest.raises(BatchError, match="ref_logprobs"):
        KLLoss()({"logprobs": logp}, batch, LossContext.of(batch))


def test_unknown_option_raises_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="clip_lo"):
        PPOLoss(clip_lo=0.2)
    with pytest.raises(ConfigError, match="estimatr"):
        KLLoss(estimatr="k1")


def test_invalid_option_values_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="dual_clip"):
        PPOLoss(dual_clip=1.0)  # must be > 1
    with pytest.raises(ConfigError, match="estimator"):
        KLLoss(estimator="k4")
    with pytest.raises(ConfigError, match="low bound 1.0 is above the high bound -1.0"):
        PPOLoss(log_ratio_bounds=(1, -1))
    with pytest.raises(ConfigError, match="ratio_floor 10.0 is above ratio_cap 2.0"):
        CISPOLoss(ratio_floor=10, ratio_cap=2)
    assert PPOLoss(log_ratio_bounds=(None, 10)) and CISPOLoss(ratio_floor=0.8, ratio_cap=1.2)


@pytest.mark.parametrize("options", [{"log_ratio_bounds": (float("nan"), 1.0)}, {"entropy_floor": float("nan")},
                                     {"off_policy_threshold": float("nan")}, {"clip_high": float("inf")}])
def test_nan_or_infinite_options_are_refused_naming_them(options) -> None:
    """A NaN bound would mask every token (nothing trained) or make a NaN loss whose gradient poisons
    what earlier calls accumulated: refused like any other bad value ("no bound" is None)."""
    name = next(iter(options))
    with pytest.raises(ConfigError, match=rf"{name}(\.0)?: Input should be a finite number"):
        PPOLoss(**options)


def test_gspo_under_token_mean_weighs_each_sequence_by_its_tokens() -> None:
    """Any aggregation: the sequence's loss is carried by each of its tokens (TRL's broadcast), so
    token-mean gives sum_i len_i * L_i / tokens and the gradient of each sequence's ratio."""
    batch, logp = gspo_case()
    loss, _ = GSPOLoss(aggregation="token-mean")({"logprobs": logp}, batch, LossContext.of(batch))
    lens, mask = [3, 2, 2], batch.loss_mask.to(F64)
    log_w = ((logp - batch.old_logprobs) * mask).sum(-1) / mask.sum(-1)
    ratio = torch.exp(log_w)
    adv = torch.tensor(GSPO_ADV, dtype=F64)
    per_seq = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 3e-4, 1 + 4e-4))
    expected = (per_seq * torch.tensor(lens, dtype=F64)).sum() / 7
    assert loss.item() == pytest.approx(expected.item(), abs=TOL)
    (grad,) = torch.autograd.grad(loss, logp)
    (want,) = torch.autograd.grad(expected, logp)
    assert_rows(grad.tolist(), want.tolist())


def test_two_sided_clip_caps_the_ratio_of_negative_advantages() -> None:
    """delta = 1.3: row 1 (A = -2) ratio 1.1 stays; the same row with ratio 2.0 would cost 2 * 1.3."""
    batch = make_batch([2], old_logprobs=[[-1.0, -1.0]], advantages=[-2.0])
    logp = logprobs_from([[-1.0, -1.0]], [[math.log(1.1), math.log(2.0)]])
    loss, _ = PPOLoss(delta=1.3, aggregation="token-mean")({"logprobs": logp}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx((2 * 1.1 + 2 * 1.3) / 2, abs=TOL)
    assert_rows(grad_of(loss, logp), [[2 * 1.1 / 2, 0.0]])  # the capped token has no gradient
    with pytest.raises(ConfigError, match="delta"):
        PPOLoss(delta=1.0)  # must be > 1


def test_entropy_floor_keeps_only_high_entropy_tokens_with_the_same_normaliser() -> None:
    batch, logp = ppo_case()
    entropy = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.7, 0.0]], dtype=F64)
    full, _ = PPOLoss(**PPO_OPTS)({"logprobs": logp}, batch, LossContext.of(batch))
    term = PPOLoss(**PPO_OPTS, entropy_floor=0.5)
    assert term.requires == ("logprobs", "entropy")
    loss, metrics = term({"logprobs": logp, "entropy": entropy}, batch, LossContext.of(batch))
    # kept: row 0 tokens 0 and 2 (-1.25, -0.5), row 1 token 1 (2.2); divided by all 5 tokens
    assert loss.item() == pytest.approx((-1.25 - 0.5 + 2.2) / 5, abs=TOL)
    assert metrics["kept"] == pytest.approx(3 / 5, abs=MTOL)
    assert full.item() == pytest.approx(0.77 / 5, abs=TOL)


def test_off_policy_mask_drops_drifted_negative_advantage_sequences() -> None:
    """Row 1 (A = -2) has mean KL(old || current) = -(log 0.5 + log 1.1) / 2 = 0.299; row 0 (A > 0)
    is always kept."""
    batch, logp = ppo_case()
    kept, _ = PPOLoss(**PPO_OPTS, off_policy_threshold=0.3)({"logprobs": logp}, batch, LossContext.of(batch))
    dropped, metrics = PPOLoss(**PPO_OPTS, off_policy_threshold=0.29)({"logprobs": logp}, batch, LossContext.of(batch))
    assert kept.item() == pytest.approx(0.77 / 5, abs=TOL)
    assert dropped.item() == pytest.approx(-3.03 / 5, abs=TOL) and metrics["kept"] == pytest.approx(3 / 5, abs=MTOL)


def test_cispo_sapo_vespo_against_their_formulas() -> None:
    batch, logp = ppo_case()
    ctx, mask = LossContext.of(batch), batch.loss_mask.to(F64)
    adv = torch.tensor(PPO_ADV, dtype=F64)[:, None]
    ratio = torch.exp((logp - batch.old_logprobs) * mask)
    tau = torch.where(adv > 0, 1.0, 1.05)  # SAPO's temperature_pos where A > 0, else temperature_neg
    cases = {
        CISPOLoss(ratio_cap=1.3): -ratio.clamp(max=1.3).detach() * adv * logp,
        SAPOLoss(): -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv,
    }
    log_w = ((logp - batch.old_logprobs) * mask).sum(-1, keepdim=True).detach()
    k, lam = torch.where(adv >= 0, 2.0, 3.0), torch.where(adv >= 0, 3.0, 2.0)
    cases[VESPOLoss()] = -torch.exp(lam + k * log_w - lam * torch.exp(log_w)) * adv * logp
    for term, per_token in cases.items():
        loss, _ = term({"logprobs": logp}, batch, ctx)
        expected = (per_token * mask).sum() / 5
        assert loss.item() == pytest.approx(expected.item(), abs=TOL), term.name
        (grad,) = torch.autograd.grad(loss, logp)
        (want,) = torch.autograd.grad(expected, logp)
        assert_rows(grad.tolist(), want.tolist())
    with pytest.raises(ConfigError, match="VESPO"):
        VESPOLoss(level="sequence")


# The sampler's log-probs of the PPO batch: exp(old - sampling) per token is 2, 0.5, 4 | 1.5, 0.25
# (sequence products: 4 and 0.375).
SAMPLER_WEIGHTS = [[2.0, 0.5, 4.0], [1.5, 0.25]]
SAMPLING = [[o - math.log(w) for o, w in zip(orow, wrow, strict=True)]
            for orow, wrow in zip(PPO_OLD, SAMPLER_WEIGHTS, strict=True)]


@pytest.mark.parametrize("mode, low, expected", [
    ("token-truncate", 0.3, [[2.0, 0.5, 3.0], [1.5, 0.3]]),
    ("token-mask", 0.3, [[2.0, 0.5, 0.0], [1.5, 0.0]]),
    ("sequence-truncate", None, [[3.0] * 3, [0.375] * 2]),
    ("sequence-mask", 0.5, [[0.0] * 3, [0.0] * 2]),
    ("sequence-mask", None, [[0.0] * 3, [0.375] * 2]),
])
def test_the_sampler_correction_weighs_each_tokens_policy_loss(mode, low, expected) -> None:
    """exp(old - sampling), per token or per sequence, clamped to [low, 3] or zero outside it,
    multiplies each token's PPO loss (detached: the gradient is the weighted one)."""
    batch, logp = ppo_case(sampling_logprobs=SAMPLING)
    ctx, mask = LossContext.of(batch), batch.loss_mask.to(F64)
    correction = {"mode": mode, "low": low, "high": 3.0}
    loss, metrics = PPOLoss(**PPO_OPTS, sampler_correction=correction)({"logprobs": logp}, batch, ctx)
    plain, _ = PPOLoss(**PPO_OPTS)({"logprobs": logp.detach().requires_grad_()}, batch, ctx)
    ratio = torch.exp((logp - batch.old_logprobs) * mask)
    adv = torch.tensor(PPO_ADV, dtype=F64)[:, None]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    weights = torch.tensor(pad(expected, 3), dtype=F64)
    want = (per_token * weights * mask).sum() / 5
    # (the sampler's log-probs are read as float32, as the old ones are)
    assert loss.item() == pytest.approx(want.item(), abs=MTOL) and plain.item() == pytest.approx(0.77 / 5, abs=TOL)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    assert_rows(grad.tolist(), want_grad.tolist(), MTOL)
    diffs = [abs(math.log(w)) for row in SAMPLER_WEIGHTS for w in row]
    assert metrics["sampler_logp_diff"] == pytest.approx(sum(diffs) / 5)
    assert metrics["sampler_logp_diff_max"] == pytest.approx(max(diffs))
    counted = [row[0] for row in expected] if mode.startswith("sequence") else [w for row in expected for w in row]
    assert metrics["sampler_weight"] == pytest.approx(sum(counted) / len(counted))
    assert (metrics["sampler_weight_min"], metrics["sampler_weight_max"]) == pytest.approx((min(counted), max(counted)))


@pytest.mark.parametrize("correction, expected", [
    ({"reject_tokens": {"low": 0.3, "high": 3.0}}, [[1.0, 1.0, 0.0], [1.0, 0.0]]),
    ({"reject_sequences_with_token": {"high": 3.0}}, [[0.0] * 3, [1.0] * 2]),
    ({"reject_sequences": {"low": 0.3, "high": 3.0}}, [[0.0] * 3, [1.0] * 2]),  # products 4 and 0.375
    ({"reject_sequences": {"low": 0.7, "statistic": "geometric"}}, [[1.0] * 3, [0.0] * 2]),  # 1.59 and 0.61
    # the sequence weight and the geometric mean count only the tokens the token rule keeps: 1 and 1.5
    ({"mode": "sequence-truncate", "reject_tokens": {"low": 0.3, "high": 3.0},
      "reject_sequences": {"high": 1.6, "statistic": "geometric"}}, [[1.0, 1.0, 0.0], [1.5, 0.0]]),
])
def test_sampler_rejections_drop_tokens_and_sequences_from_the_policy_term(correction, expected) -> None:
    """Rejected tokens weigh 0 and still count in the normaliser (SkyRL's masks); the sampler
    weights per token are 2, 0.5, 4 | 1.5, 0.25."""
    batch, logp = ppo_case(sampling_logprobs=SAMPLING)
    ctx, mask = LossContext.of(batch), batch.loss_mask.to(F64)
    correction = {"mode": "none", **correction}
    loss, metrics = PPOLoss(**PPO_OPTS, sampler_correction=correction)({"logprobs": logp}, batch, ctx)
    ratio = torch.exp((logp - batch.old_logprobs) * mask)
    adv = torch.tensor(PPO_ADV, dtype=F64)[:, None]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    want = (per_token * torch.tensor(pad(expected, 3), dtype=F64) * mask).sum() / 5
    assert loss.item() == pytest.approx(want.item(), abs=MTOL)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    assert_rows(grad.tolist(), want_grad.tolist(), MTOL)
    assert metrics["sampler_rejected"] == pytest.approx(sum(w == 0.0 for row in expected for w in row) / 5)
    with pytest.raises(ConfigError, match="without rejections"):
        VESPOLoss(sampler_correction=correction)


def test_a_sequence_ratio_with_token_gradients_is_verls_gspo() -> None:
    """``sequence_gradient: token``: each token carries its sequence's ratio s_i, with its own
    log-prob's gradient (verl's sg[s_i] * pi_t / sg[pi_t]): d loss / d logp_t = -A w_t s_i for a
    token sum weighed by sampler weights w_t; through the mean, every token gets the mean of those."""
    batch, logp = ppo_case(sampling_logprobs=SAMPLING)
    ctx, mask = LossContext.of(batch), batch.loss_mask.to(F64)
    options = {"clip_low": 0.99, "clip_high": 100.0, "aggregation": "token-sum",
               "sampler_correction": {"mode": "token-truncate", "high": 100.0}}
    adv = torch.tensor(PPO_ADV, dtype=F64)[:, None]
    seq_ratio = torch.exp(((logp - batch.old_logprobs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    weights = torch.tensor(pad(SAMPLER_WEIGHTS, 3), dtype=F64)
    per_token = (-adv * seq_ratio * weights * mask).detach()
    for gradient, want in (("token", per_token),
                           ("mean", per_token.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True) * mask)):
        loss, _ = GSPOLoss(**options, sequence_gradient=gradient)({"logprobs": logp}, batch, ctx)
        assert loss.item() == pytest.approx(per_token.sum().item(), abs=MTOL), gradient
        (grad,) = torch.autograd.grad(loss, logp)
        assert_rows(grad.tolist(), want.tolist(), MTOL)


def test_vespo_folds_token_sampler_weights_into_its_sequence_weight() -> None:
    """VESPO's w is the sequence's ratio times the product of its (truncated) sampler weights."""
    batch, logp = ppo_case(sampling_logprobs=SAMPLING)
    ctx, mask = LossContext.of(batch), batch.loss_mask.to(F64)
    correction = {"mode": "token-truncate", "high": 3.0}
    loss, _ = VESPOLoss(sampler_correction=correction)({"logprobs": logp}, batch, ctx)
    adv = torch.tensor(PPO_ADV, dtype=F64)[:, None]
    sampler = torch.tensor(pad([[2.0, 0.5, 3.0], [1.5, 0.25]], 3, 1.0), dtype=F64)
    log_w = (((logp - batch.old_logprobs) + torch.log(sampler)) * mask).sum(-1, keepdim=True).detach()
    k, lam = torch.where(adv >= 0, 2.0, 3.0), torch.where(adv >= 0, 3.0, 2.0)
    want = (-torch.exp(lam + k * log_w - lam * torch.exp(log_w)) * adv * logp * mask).sum() / 5
    assert loss.item() == pytest.approx(want.item(), abs=MTOL)
    with pytest.raises(ConfigError, match="token-truncate or token-mask"):
        VESPOLoss(sampler_correction={"mode": "sequence-mask"})
    with pytest.raises(BatchError, match="sampling_logprobs"):
        PPOLoss(sampler_correction={})({"logprobs": logp}, ppo_case()[0], ctx)
    with pytest.raises(ConfigError, match="above high"):
        PPOLoss(sampler_correction={"low": 4.0, "high": 3.0})


@pytest.mark.parametrize("trust_region", ["advantage-sign", "both-sides"])
def test_dppo_with_the_squared_log_ratio_kl_against_its_formula(trust_region: str) -> None:
    """dppo + kl(against old, k2, weight 2 tau) is DPPO-Binary TV + Kimi's KL: -A * ratio on the
    tokens whose probability moved within [-mask_low, mask_high], plus tau * log(ratio)^2.
    Probability changes p_old * (ratio - 1): row 0 (A = +1) +0.092, +0.303, -0.068; row 1 (A = -2)
    -0.112, +0.078. advantage-sign drops row 0's rise (> 0.2) and row 1's fall (< -0.05); both-sides
    also drops row 0's fall of 0.068."""
    batch, logp = ppo_case()
    ctx, mask, tau = LossContext.of(batch), batch.loss_mask, 1e-3
    adv = torch.tensor(PPO_ADV, dtype=F64)[:, None].expand_as(logp)
    objective = build_objective(default_registry(), [
        LossTermConfig(name="dppo", mask_low=0.05, mask_high=0.2, trust_region=trust_region),
        LossTermConfig(name="kl", weight=2 * tau, against="old", estimator="k2", clamp=None)])
    loss, metrics = objective({"logprobs": logp}, batch, ctx)
    log_ratio = (logp - batch.old_logprobs) * mask
    change = torch.exp(logp) - torch.exp(batch.old_logprobs)
    rose, fell = change > 0.2, change < -0.05
    dropped = torch.where(adv > 0, rose, fell) if trust_region == "advantage-sign" else rose | fell
    per_token = -(mask & ~dropped).to(F64) * adv * torch.exp(log_ratio) + tau * mask * log_ratio**2
    expected = per_token.sum() / 5
    assert dropped[mask].sum() == (2 if trust_region == "advantage-sign" else 3)
    assert loss.item() == pytest.approx(expected.item(), abs=TOL)
    assert metrics["dppo/masked"] == pytest.approx(float(dropped[mask].sum()) / 5, abs=MTOL)
    (grad,) = torch.autograd.grad(loss, logp)
    (want,) = torch.autograd.grad(expected, logp)
    assert_rows(grad.tolist(), want.tolist())
    with pytest.raises(BatchError, match="against: old needs batch.old_logprobs"):
        KLLoss(against="old")({"logprobs": logp}, batch.replace(old_logprobs=None), ctx)


def test_cispo_floor_plain_policy_gradient_and_log_ratio_bounds() -> None:
    """CISPO with a floor clips its detached weight on both sides; pg is -A * log-prob; bounds
    clamp the log ratio before the exp, leaving no gradient outside them."""
    batch, logp = ppo_case()
    ctx, mask = LossContext.of(batch), batch.loss_mask.to(F64)
    adv = torch.tensor(PPO_ADV, dtype=F64)[:, None]
    log_ratio = (logp - batch.old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    bounded = log_ratio.clamp(-0.5, 0.2)  # ratios 1.25, 1.5, 0.5 / 0.5, 1.1 -> e^0.2 caps 1.25 and 1.5
    tau = torch.where(adv > 0, 1.0, 1.05)  # SAPO's temperature_pos where A > 0, else temperature_neg
    cases = {
        CISPOLoss(ratio_cap=1.3, ratio_floor=0.8): -ratio.clamp(0.8, 1.3).detach() * adv * logp,
        PolicyGradientLoss(): -adv * logp,
        SAPOLoss(log_ratio_bounds=(-0.5, 0.2)): -torch.sigmoid(tau * (torch.exp(bounded) - 1)) * 4 / tau * adv,
        PPOLoss(clip_low=10.0, clip_high=10.0,
                log_ratio_bounds=(None, 0.2)): -adv * torch.exp(log_ratio.clamp(max=0.2)),
    }
    for term, per_token in cases.items():
        loss, _ = term({"logprobs": logp}, batch, ctx)
        expected = (per_token * mask).sum() / 5
        assert loss.item() == pytest.approx(expected.item(), abs=TOL), term.name
        (grad,) = torch.autograd.grad(loss, logp)
        (want,) = torch.autograd.grad(expected, logp, retain_graph=True)  # the cases share a graph
        assert_rows(grad.tolist(), want.tolist())
    (grad,) = torch.autograd.grad(PPOLoss(log_ratio_bounds=(None, 0.2))({"logprobs": logp}, batch, ctx)[0], logp)
    assert grad[0, 0] == 0 and grad[0, 1] == 0 and grad[0, 2] != 0  # ratios 1.25, 1.5 exceed e^0.2


def test_kl_abs_estimator_and_the_k2_gradient_with_the_estimators_value() -> None:
    """abs is |log pi/ref|; gradient k2 keeps the estimator's value and takes k2's gradient
    (the straight-through estimate verl calls 'k3+')."""
    batch, logp = ppo_case(ref_logprobs=[[-1.5, -0.5, -1.0], [-1.0, -0.5]])
    ctx, mask = LossContext.of(batch), batch.loss_mask.to(F64)
    diff = logp - batch.ref_logprobs
    loss, _ = KLLoss(estimator="abs", clamp=None)({"logprobs": logp}, batch, ctx)
    assert loss.item() == pytest.approx(((diff.abs() * mask).sum() / 5).item(), abs=TOL)
    loss, _ = KLLoss(estimator="k3", gradient="k2")({"logprobs": logp}, batch, ctx)
    k3 = torch.exp(-diff) - 1 + diff
    assert loss.item() == pytest.approx(((k3 * mask).sum() / 5).item(), abs=TOL)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_rows(grad.tolist(), (diff * mask / 5).tolist())  # d/dlogp of 0.5 * diff^2, token-mean


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ratio_weighted_kl_is_k3_times_the_importance_ratio_with_its_gradient(level) -> None:
    batch, logp = ppo_case(ref_logprobs=[[-1.5, -0.5, -1.0], [-1.0, -0.5]])
    loss, _ = KLLoss(ratio_weighted=True, level=level, clamp=None)({"logprobs": logp}, batch, LossContext.of(batch))
    mask = batch.loss_mask.to(F64)
    log_ratio = (logp - batch.old_logprobs) * mask
    if level == "sequence":
        log_ratio = ((log_ratio.sum(-1) / mask.sum(-1))[:, None]).expand_as(logp)
    k3 = torch.exp(batch.ref_logprobs - logp) - (batch.ref_logprobs - logp) - 1
    expected = (k3 * torch.exp(log_ratio) * mask).sum() / 5
    assert loss.item() == pytest.approx(expected.item(), abs=TOL)
    (grad,) = torch.autograd.grad(loss, logp)
    (want,) = torch.autograd.grad(expected, logp)
    assert_rows(grad.tolist(), want.tolist())


def test_entropy_bonus_with_a_floor_counts_only_high_entropy_tokens() -> None:
    batch = make_batch([3, 2])
    entropy = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.7, 0.0]], dtype=F64, requires_grad=True)
    loss, metrics = EntropyBonus(entropy_floor=0.5)({"entropy": entropy}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx(-(0.9 + 0.5 + 0.7) / 5, abs=TOL) and metrics["kept"] == pytest.approx(0.6)


# --------------------------------------------------------------------------- objective
def test_build_objective_weights_terms() -> None:
    batch, logp = ppo_case(ref_logprobs=PPO_OLD)  # ref = old, so k1 = mean log(ratio)
    objective = build_objective(
        default_registry(), [LossTermConfig(name="ppo"), LossTermConfig(name="kl", weight=0.1, estimator="k1")]
    )
    assert set(objective.processors) == {"logprobs"}
    total, metrics = objective({"logprobs": logp}, batch, LossContext.of(batch))
    # PPO with default options (clip_low = clip_high = 0.2): 0.9 / 5 = 0.18, see the symmetric-clip test
    ppo = 0.18
    kl = (math.log(1.25) + math.log(1.5) + 2 * math.log(0.5) + math.log(1.1)) / 5  # = -0.1324758...
    assert metrics["ppo/loss"] == pytest.approx(ppo, abs=TOL)
    assert metrics["kl/kl"] == pytest.approx(kl, abs=TOL)
    assert metrics["kl/loss"] == pytest.approx(kl, abs=TOL)
    assert total.item() == pytest.approx(ppo + 0.1 * kl, abs=TOL)
    assert metrics["loss"] == pytest.approx(ppo + 0.1 * kl, abs=TOL)
    assert {"ppo/loss", "ppo/clipfrac", "kl/kl", "kl/loss", "loss"} <= set(metrics)


def test_a_term_of_weight_zero_is_reported_but_not_trained_on() -> None:
    """An entropy of weight 0 beside the policy term: its metrics come back, the loss and the
    gradient are the policy term's alone, and no backward reaches the entropies (even a NaN there
    leaves the loss finite)."""
    batch, logp = ppo_case()
    entropy = torch.tensor([[0.9, float("nan"), 0.5], [0.2, 0.7, 0.0]], dtype=F64, requires_grad=True)
    terms = [LossTermConfig(name="ppo"), LossTermConfig(name="entropy", weight=0.0)]
    objective = build_objective(default_registry(), terms)
    assert set(objective.processors) == {"logprobs", "entropy"}
    total, metrics = objective({"logprobs": logp, "entropy": entropy}, batch, LossContext.of(batch))
    assert total.item() == pytest.approx(0.18, abs=TOL)  # the ppo term alone (see the test above)
    assert "entropy/entropy" in metrics and "entropy/loss" in metrics
    total.backward()
    assert entropy.grad is None and logp.grad is not None
    only_zero = build_objective(default_registry(), [LossTermConfig(name="ppo", weight=0.0)])
    total, _ = only_zero({"logprobs": logp}, batch, LossContext.of(batch))
    (grad,) = torch.autograd.grad(total, logp)  # a zero loss that still reaches the weights
    assert total.item() == 0.0 and not grad.any()


def test_build_objective_unknown_loss_lists_registered_names() -> None:
    with pytest.raises(PluginNotFoundError, match="ppo") as info:
        build_objective(default_registry(), [LossTermConfig(name="nope")])
    assert "'nope'" in str(info.value)
    assert "kl" in str(info.value)


class _Returns:
    """A third party's loss term that returns ``value`` (and reads the log-probs)."""

    requires = ("logprobs",)

    def __init__(self, value=None) -> None:
        self.value = value

    def __call__(self, outputs, batch, ctx):
        return self.value(outputs["logprobs"]) if callable(self.value) else self.value


def _plugin_registry(**losses):
    import types

    from arctic_core import hookimpl
    from arctic_core.plugins.registry import build_registry

    module = types.ModuleType("mine")
    module.arctic_losses = hookimpl(lambda: losses)

    class NoTemperature:
        outputs = ("logprobs",)

    module.arctic_processors = hookimpl(lambda: {"no_temperature": NoTemperature})
    return build_registry({"mine": module})


def test_a_plugin_term_that_breaks_the_loss_contract_is_named_before_any_gradient() -> None:
    """Each broken plugin names itself and the rule, at the dry run that precedes any engine's
    work, instead of failing deep inside the backward with the engine's error."""
    from helpers import random_grpo_batch

    batch = random_grpo_batch(64)
    broken = {
        "a float": (lambda lp: 0.5, "returned a float, not a pair (loss, metrics)"),
        "a tensor alone": (lambda lp: lp.sum(), "returned a tensor of shape [], not a pair (loss, metrics)"),
        "per-token losses": (lambda lp: (lp, {}), "returned a loss that is a tensor of shape [15, "),
        "a text metric": (lambda lp: (lp.sum(), {"note": "ok"}), "returned metrics ['note'] that are not 0-dim"),
    }
    for case, (value, message) in broken.items():
        objective = build_objective(_plugin_registry(mine=lambda v=value: _Returns(v)), [LossTermConfig(name="mine")])
        with pytest.raises(RequestError, match=re.escape(f"loss term 'mine' {message}")) as refused:
            objective.check(batch, LossContext.of(batch))
        assert "a term returns (0-dim loss tensor, {metric: 0-dim tensor or number})" in str(refused.value), case
    good = build_objective(_plugin_registry(mine=lambda: _Returns(lambda lp: (lp.sum(), {"n": 1}))),
                           [LossTermConfig(name="mine")])
    good.check(batch, LossContext.of(batch))

    class NoRequires:
        def __call__(self, outputs, batch, ctx):
            return torch.zeros(()), {}

    with pytest.raises(RequestError, match="loss term 'mine' declares no `requires`"):
        build_objective(_plugin_registry(mine=NoRequires), [LossTermConfig(name="mine")])
    from arctic_core.losses.objective import build_processors

    with pytest.raises(RequestError, match="processor 'no_temperature' cannot be built as processors are"):
        build_processors(_plugin_registry(), ["no_temperature"], 1.0)


def test_a_name_given_to_several_terms_reports_each_terms_metrics_and_no_term_reports_loss() -> None:
    batch, logp = ppo_case(ref_logprobs=PPO_OLD)
    terms = [LossTermConfig(name="kl", estimator="k1"), LossTermConfig(name="kl", estimator="k3", weight=0.5)]
    total, metrics = build_objective(default_registry(), terms)({"logprobs": logp}, batch, LossContext.of(batch))
    k1, k3 = metrics["kl/loss"], metrics["kl.2/loss"]
    assert k1 != k3 and total.item() == pytest.approx(float(k1) + 0.5 * float(k3), abs=TOL)
    objective = build_objective(_plugin_registry(mine=lambda: _Returns(lambda lp: (lp.sum(), {"loss": 1.0}))),
                                [LossTermConfig(name="mine")])
    with pytest.raises(RequestError, match=r"loss term 'mine' returned a metric named 'loss' \(the term's loss is"):
        objective.check(batch, LossContext.of(batch))


def test_a_loss_with_no_gradient_names_the_term_or_the_processor() -> None:
    """A backward of a loss with no gradient fails naming nothing: the objective names the cause."""
    batch, logp = ppo_case()
    detached = build_objective(_plugin_registry(mine=lambda: _Returns(lambda lp: (lp.detach().sum(), {}))),
                               [LossTermConfig(name="ppo"), LossTermConfig(name="mine")])
    detached({"logprobs": logp}, batch, LossContext.of(batch))  # ppo's gradient carries the sum
    alone = build_objective(_plugin_registry(mine=lambda: _Returns(lambda lp: (lp.detach().sum(), {}))),
                            [LossTermConfig(name="mine")])
    with pytest.raises(RequestError, match=r"no gradient: loss term\(s\) \['mine'\] returned a loss that does not"):
        alone({"logprobs": logp}, batch, LossContext.of(batch))
    ppo = build_objective(default_registry(), [LossTermConfig(name="ppo")])
    with pytest.raises(RequestError, match=r"the processors' outputs \['logprobs'\] do not depend on the weights"):
        ppo({"logprobs": logp.detach()}, batch, LossContext.of(batch))
    with torch.no_grad():  # log-probs only: no gradient asked for
        ppo({"logprobs": logp.detach()}, batch, LossContext.of(batch))


class _Processor:
    def __init__(self, outputs=("pout",), result=None, temperature: float = 1.0) -> None:
        self.outputs, self.result = outputs, result

    def __call__(self, logits, targets):
        return self.result(logits, targets)


def test_processors_that_clash_or_break_their_contract_are_named() -> None:
    import types

    from arctic_core import hookimpl
    from arctic_core.losses.objective import build_processors, check_processor_outputs
    from arctic_core.plugins.registry import build_registry

    module = types.ModuleType("procs")
    module.arctic_processors = hookimpl(lambda: {"fancy": lambda temperature: _Processor(("logprobs",)),
                                                 "unnamed": lambda temperature: _Processor(("pout", 3))})
    registry = build_registry({"procs": module})
    with pytest.raises(RequestError, match="processors 'logprobs' and 'fancy' both produce 'logprobs'"):
        build_processors(registry, ["logprobs", "fancy"], 1.0)
    with pytest.raises(RequestError, match=r"processor 'unnamed' declares outputs \('pout', 3\)"):
        build_processors(registry, ["unnamed"], 1.0)
    logits, targets = torch.randn(10, 7), torch.randint(0, 7, (10,))
    gathered = logits.gather(1, targets[:, None]).squeeze(1)
    check_processor_outputs(_Processor(), {"pout": gathered}, 10)
    for produced, message in (({"other": gathered}, r"returned \['other'\]: a processor returns a dict of exactly"),
                              ({"pout": logits}, r"returned 'pout' as a tensor of shape \[10, 7\] of torch.float32"),
                              ({"pout": targets},
                               r"returned 'pout' .* of torch.int64: each output is a float tensor of shape \[N\]"),
                              ([gathered], "returned list")):
        with pytest.raises(RequestError, match=r"processor _Processor \(outputs \('pout',\)\) " + message):
            check_processor_outputs(_Processor(), produced, 10)
