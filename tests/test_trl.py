"""arctic_trl: TRL 1.16's GRPOTrainer on the Arctic backend (real TRL, real DeepSpeed, CPU)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM

from arctic_core.config import ArcticConfig
from arctic_trl import GRPOTrainer
from arctic_trl.mapping import VLLM_SETTINGS, arctic_config, regroup_is_exact, unsupported, vllm_notice
from arctic_trl.trainer import _model_folder, group_micro_batches
from helpers import weights

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import trl_grpo

pytestmark = pytest.mark.slow


def test_installing_arctic_trl_alone_brings_the_engines_of_its_default_backend():
    """TRL on Arctic runs in process by default: a DeepSpeed trainer (arctic-zorro) and the embedded
    sampler (arctic-fca), which ``pip install arctic-trl`` must install with it."""
    from importlib.metadata import requires

    from arctic_core.config import SamplerConfig, TrainerConfig

    assert (TrainerConfig().backend, SamplerConfig().backend) == ("deepspeed", "embedded")
    required = {re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requires("arctic-trl") if "extra ==" not in r}
    assert {"arctic-core", "arctic-zorro", "arctic-fca"} <= required


def test_trl_script_trains_through_arctic_and_logs_our_metrics(tmp_path):
    history = trl_grpo.main(["--steps", "12", "--out", str(tmp_path)])
    rewards = [h["reward"] for h in history if "reward" in h]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
    logged = {key for h in history for key in h}
    assert {"arctic/loss", "arctic/ppo/clipfrac", "arctic/step/grad_norm", "arctic/step/policy_version",
            "arctic/generate/seconds"} <= logged
    steps = [h for h in history if "arctic/step/grad_norm" in h]
    assert all(h["grad_norm"] == h["arctic/step/grad_norm"] > 0 for h in steps), steps


@pytest.fixture(scope="module")
def policy(tiny_policy) -> str:
    """The shared tiny policy (arctic_core.testing) as the model id string TRL takes."""
    return str(tiny_policy)


def grpo_args(tmp_path, **overrides) -> trl.GRPOConfig:
    settings = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=8, logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0,
                    save_strategy="no", gradient_checkpointing=False, learning_rate=1e-3)
    return trl.GRPOConfig(**{**settings, **overrides})


def variety_reward(completion_ids, **kwargs) -> list[float]:
    """Share of distinct tokens: differs between samples of a prompt, so advantages are not zero."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


DATASET = Dataset.from_dict({"prompt": ["count up from 3:", "count down from 9:", "repeat 5:", "count up from 1:"] * 2})


# The lengths the parity tests' completions end at, sample by sample (groups of num_generations=4
# samples per prompt): EOS at different positions, or max_completion_length (8) without EOS, a
# truncated completion. The tiny policy's own samples run to the limit, and with completions all of
# one length a per-token mean, a per-sequence mean and Dr. GRPO's constant normaliser agree: a loss
# type mapped to another's reduction would pass. With lengths that differ within each group, and
# the padding after each EOS masked, every loss type's reduction is pinned down (and so are the
# sequence-level ratios, the sampler correction's sequence modes and the per-sequence metrics).
COMPLETION_LENGTHS = (8, 3, 6, 1, 5, 8, 2, 8)


def varied_lengths(completions: list[list[int]], eos: int, limit: int) -> list[list[int]]:
    """The sampled ``completions`` cut to ``COMPLETION_LENGTHS`` in turn: ending with ``eos``, or,
    at ``limit``, as sampled (truncated)."""
    cut = []
    for i, ids in enumerate(completions):
        length = COMPLETION_LENGTHS[i % len(COMPLETION_LENGTHS)]
        cut.append(list(ids[:length]) if length == limit else [*ids[:length - 1], eos])
    return cut


class VariedLengthGRPOTrainer(trl.GRPOTrainer):
    """Plain TRL whose generation (the model's own sampling) ends each completion at a length of
    ``COMPLETION_LENGTHS``; everything after generation (rewards, masks, log-probs, the loss) is TRL's."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                              has_tool_images)
        assert logprobs is None  # transformers' generation: no sampler log-probs to cut with them
        return varied_lengths(completions, self.eos_token_ids[0], self.max_completion_length), logprobs


def assert_lengths_differ(inputs: dict, num_generations: int = 4) -> None:
    """The prepared batch has completions of at least 3 lengths among each prompt's samples, and
    masked positions (the padding after an EOS)."""
    mask = inputs["completion_mask"]
    assert (mask == 0).any(), "no masked completion tokens"
    groups: dict[tuple, list[int]] = {}  # TRL shuffles the rows: a prompt's samples by their prompt
    for prompt, prompt_mask, length in zip(inputs["prompt_ids"], inputs["prompt_mask"], mask.sum(1).tolist(),
                                           strict=True):
        groups.setdefault(tuple(prompt[prompt_mask.bool()].tolist()), []).append(length)
    assert all(len(lengths) >= num_generations and len(set(lengths)) >= 3 for lengths in groups.values()), groups


def mean_token_reward(completion_ids, **kwargs) -> list[float]:
    """The mean token id: differs between any two samples of a prompt (the tiny policy's samples
    mostly have no repeated token, so variety_reward ties), so every row has an advantage and rows
    of every length weigh in the loss."""
    return [sum(ids) / len(ids) / 100 for ids in completion_ids]


def plain_and_arctic(policy: str, tmp_path, **settings):
    """A plain TRL trainer with its first prepared batch (completions of varied lengths, each with
    an advantage), and an Arctic trainer with the same settings: each test computes the same loss
    on both sides."""
    plain, window, arctic = plain_window_and_arctic(policy, tmp_path, **settings)
    return plain, window[0], arctic


def plain_window_and_arctic(policy: str, tmp_path, **settings):
    """``plain_and_arctic`` with the prepared micro-batches of the first optimizer step (all of
    them: ``gradient_accumulation_steps``), whose rows together have varied lengths and advantages."""
    args = grpo_args(tmp_path, **settings)
    plain = VariedLengthGRPOTrainer(model=policy, reward_funcs=mean_token_reward, args=args, train_dataset=DATASET)
    plain.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by HF's loop
    plain.model.train()
    plain._prepare_inputs(next(iter(plain.get_train_dataloader())))
    window = plain._buffered_inputs[:args.gradient_accumulation_steps]
    keys = ("prompt_ids", "prompt_mask", "completion_mask", "advantages")
    rows = {key: torch.cat([batch[key] for batch in window]) for key in keys}
    assert (rows["advantages"] != 0).all()  # a batch that teaches something, through every row
    assert_lengths_differ(rows, args.num_generations)
    arctic = GRPOTrainer(model=policy, reward_funcs=mean_token_reward, args=grpo_args(tmp_path, **settings),
                         train_dataset=DATASET)
    arctic.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return plain, window, arctic


def plain_loss_and_grads(plain, inputs: dict):
    """Plain TRL's loss on ``inputs`` and the gradients it leaves (earlier ones cleared first)."""
    plain.model.zero_grad(set_to_none=True)
    expected = plain.compute_loss(plain.model, inputs)
    expected.backward()
    return expected.item(), {n: p.grad.clone() for n, p in plain.model.named_parameters() if p.grad is not None}


def take_arctic_grads(arctic) -> dict:
    """The Arctic server's accumulated gradients, taken out so the next call starts from zero."""
    server = arctic.arctic.transport.server
    grads = server.trainer.full_gradients()
    server.trainer.discard_gradients()
    server.gradients_pending = False
    return grads


def assert_grads_equal(grads: dict, expected: dict, case) -> None:
    assert grads.keys() == expected.keys(), case
    for name, grad in grads.items():
        assert (grad - expected[name]).norm() <= 1e-4 * expected[name].norm() + 1e-9, (case, name)


@pytest.mark.parametrize("overrides", [
    {},  # TRL's defaults: dapo, beta 0
    {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False, "entropy_coef": 0.01},
    {"loss_type": "dr_grpo", "epsilon_high": 0.28},
    {"loss_type": "bnpo", "temperature": 0.7},
], ids=["dapo", "grpo-kl-entropy", "dr_grpo", "bnpo-temperature"])
def test_first_step_loss_and_gradients_equal_plain_trl(policy, tmp_path, overrides):
    """Plain TRL prepares a batch and computes its loss and gradients; Arctic computes both from
    the same prepared batch in the backend."""
    plain, inputs, arctic = plain_and_arctic(policy, tmp_path, **overrides)
    logged = metric_counts(plain)
    expected, expected_grads = plain_loss_and_grads(plain, inputs)
    metrics = arctic.arctic_fwd_bwd(inputs)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)
    assert_grads_equal(take_arctic_grads(arctic), expected_grads, "first step")
    assert_trl_metrics_equal(plain, logged, arctic, metrics, plain.loss_type, plain.beta, "first step")
    arctic.arctic.close()


def test_truncated_completions_masked_as_trl_masks_them(policy, tmp_path):
    """``mask_truncated_completions``: TRL zeroes a truncated completion's mask row; the loss and
    gradients through Arctic equal plain TRL's, and a whole run trains (log-probs of such rows too)."""
    plain, inputs, arctic = plain_and_arctic(policy, tmp_path, mask_truncated_completions=True)
    masked = inputs["completion_mask"].sum(1) == 0
    assert masked.any(), "the batch needs truncated completions"
    kept = masked.clone()
    kept[0::2] = False  # every other truncated row as if it had ended at the limit (as wide: all ones)
    inputs = {**inputs, "completion_mask": inputs["completion_mask"].masked_fill(kept[:, None], 1)}
    expected, expected_grads = plain_loss_and_grads(plain, inputs)
    metrics = arctic.arctic_fwd_bwd(inputs)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)
    assert_grads_equal(take_arctic_grads(arctic), expected_grads, "truncated completions masked")
    arctic.arctic.close()
    args = grpo_args(tmp_path / "run", max_steps=2, num_iterations=2, mask_truncated_completions=True)
    trainer = GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=DATASET)
    trainer.train()
    trainer.arctic.close()
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2]


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
KL = {"no-kl": (0.0, True), "kl": (0.04, False), "kl-bias-corrected": (0.04, True)}


@pytest.fixture(scope="module")
def pair(policy, tmp_path_factory):
    """A plain TRL trainer, its prepared batch (with reference log-probs), and an Arctic trainer."""
    plain, inputs, arctic = plain_and_arctic(policy, tmp_path_factory.mktemp("pair"), beta=0.04)
    yield plain, inputs, arctic
    arctic.arctic.close()


def test_prompts_repeated_for_their_samples_are_tokenized_once(pair, monkeypatch):
    plain, _, arctic = pair
    prompts = ["count up from 3:"] * 4 + ["repeat 5:"] * 4 + ["count up from 3:"]
    tokenized = []
    tokenizer = arctic.processing_class

    class Counting:
        def __call__(self, text, **kwargs):
            tokenized.extend(text)
            return tokenizer(text=text, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    monkeypatch.setattr(arctic, "processing_class", Counting())
    ids, images, fields = arctic._tokenize_prompts(prompts)
    assert (ids, images, fields) == plain._tokenize_prompts(prompts)
    assert tokenized == ["count up from 3:", "repeat 5:", "count up from 3:"]
    ids[0].append(0)  # rows are lists of their own, as TRL's are
    assert ids[1] != ids[0]


def configure(trainer, **settings) -> None:
    """Set TRL settings on a built trainer, where TRL reads them (its args and its attributes)."""
    for name, value in settings.items():
        setattr(trainer.args, name, value)
        if name in ("loss_type", "importance_sampling_level", "beta", "top_entropy_quantile",
                    "off_policy_mask_threshold"):
            setattr(trainer, name, value)
    trainer.epsilon_high = trainer.args.epsilon_high


def off_policy(plain, inputs: dict, sampler: bool) -> dict:
    """The batch as a later iteration sees it: old log-probs 0.4-nat noisy around the current ones
    (ratios from ~0.5 to ~2: clipping, two-sided clipping, the CISPO cap and the off-policy mask all
    act), and with ``sampler`` the sampler's log-probs too (TRL's off-policy mask then reads them)."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        current, _, _ = plain._get_per_token_logps_and_entropies(plain.model, ids, mask,
                                                                 inputs["completion_ids"].shape[1])
    noisy = {"old_per_token_logps": current + 0.4 * torch.randn(current.shape, generator=gen)}
    if sampler:
        noisy["sampling_per_token_logps"] = current + 0.4 * torch.randn(current.shape, generator=gen)
    return {**inputs, **noisy}


LEVELS = ["token", "sequence"]
ENTROPY_QUANTILES = {"all-tokens": 1.0, "entropy-mask": 0.4}
DATA = ["on-policy", "off-policy", "off-policy-masked", "off-policy-masked-sampler"]
# (level, KL, entropy quantile, data): every pair of two settings' values meets in some case (the
# 12 cases cover all pairs of the 48 combinations); each case runs every loss type.
MATRIX = [(LEVELS[(d + k) % 2], list(KL)[k], list(ENTROPY_QUANTILES)[(d // 2 + k) % 2], DATA[d])
          for d in range(len(DATA)) for k in range(len(KL))]


def test_the_loss_matrix_meets_every_pair_of_settings():
    axes = [LEVELS, list(KL), list(ENTROPY_QUANTILES), DATA]
    for i, j in itertools.combinations(range(len(axes)), 2):
        assert {(case[i], case[j]) for case in MATRIX} == set(itertools.product(axes[i], axes[j])), (i, j)


@pytest.mark.parametrize(("level", "kl", "entropy", "data"), MATRIX, ids=["-".join(case) for case in MATRIX])
def test_the_loss_matrix_equals_plain_trl(pair, level, kl, entropy, data):
    """Every TRL 1.16 loss type x importance-sampling level x KL (off / on / bias-corrected) x
    two-sided clipping x entropy masking, on-policy and off-policy (with and without TRL's
    off-policy mask), every pair of those settings together: the loss and gradients of one
    micro-batch through Arctic equal plain TRL's on the same prepared batch (fp32)."""
    entropy_quantile = ENTROPY_QUANTILES[entropy]
    plain, inputs, arctic = pair
    if data != "on-policy":
        inputs = off_policy(plain, inputs, sampler=data.endswith("sampler"))
    beta, corrected = KL[kl]
    for loss_type in LOSS_TYPES:
        for delta in ([None, 1.5] if AGGREGATION_CLIPPED(loss_type) else [None]):
            settings = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                            use_bias_correction_kl=corrected, delta=delta, top_entropy_quantile=entropy_quantile,
                            epsilon_high=1.2 if loss_type == "cispo" else 0.28,
                            off_policy_mask_threshold=0.05 if "masked" in data else None,
                            vllm_importance_sampling_correction=False)  # plain TRL samples without vLLM here
            configure(plain, **settings)
            configure(arctic, **settings)
            logged = metric_counts(plain)
            expected, expected_grads = plain_loss_and_grads(plain, inputs)
            metrics = arctic.arctic_fwd_bwd(inputs)
            case = f"{loss_type} delta={delta}"
            assert metrics["loss"] == pytest.approx(expected, abs=1e-5), case
            assert_grads_equal(take_arctic_grads(arctic), expected_grads, case)
            assert_trl_metrics_equal(plain, logged, arctic, metrics, loss_type, beta, case)


def test_an_accumulated_step_equals_plain_trls_for_every_loss_type(policy, tmp_path):
    """Two micro-batches per optimizer step with different numbers of loss tokens. dapo, cispo and
    vespo normalise by the tokens of the whole accumulation window, the other loss types per
    micro-batch (divided by the accumulation steps): with one micro-batch per step the two scopes
    give the same weights, here they do not. Each loss type's micro-batch losses and the step's
    accumulated gradients equal plain TRL's (with the KL and an entropy bonus, which TRL scales per
    micro-batch whatever the loss type)."""
    plain, window, arctic = plain_window_and_arctic(policy, tmp_path, per_device_train_batch_size=4,
                                                    gradient_accumulation_steps=2, beta=0.04, entropy_coef=0.01)
    tokens = [int(batch["completion_mask"].sum()) for batch in window]
    assert len(tokens) == 2 and tokens[0] != tokens[1], tokens
    for loss_type in LOSS_TYPES:
        settings = dict(loss_type=loss_type, epsilon_high=1.2 if loss_type == "cispo" else 0.28,
                        vllm_importance_sampling_correction=False)
        configure(plain, **settings)
        configure(arctic, **settings)
        plain.model.zero_grad(set_to_none=True)
        for index, inputs in enumerate(window):  # TRL's backward per micro-batch: the gradients add up
            expected = plain.compute_loss(plain.model, inputs)
            expected.backward()
            metrics = arctic.arctic_fwd_bwd(inputs)
            assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-5), (loss_type, index)
        expected_grads = {n: p.grad.clone() for n, p in plain.model.named_parameters() if p.grad is not None}
        assert_grads_equal(take_arctic_grads(arctic), expected_grads, loss_type)
    arctic.arctic.close()


def trl_vllm_importance_sampling(plain, inputs: dict) -> dict:
    """``inputs`` as TRL prepares them when vLLM sampled (``_generate_and_score_completions`` with
    ``use_vllm`` and ``vllm_importance_sampling_correction``): the trainer's old log-probs and the
    importance-sampling ratio against the sampler's, truncated or masked as the mode says."""
    old = inputs.get("old_per_token_logps")
    if old is None:  # TRL computes them whenever vLLM samples
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            old, _, _ = plain._get_per_token_logps_and_entropies(plain.model, ids, mask,
                                                                 inputs["completion_ids"].shape[1])
    args = plain.args
    diff = torch.nan_to_num((old - inputs["sampling_per_token_logps"]) * inputs["completion_mask"], nan=0.0)
    if args.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if args.vllm_importance_sampling_mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=low, max=high)
    else:
        ratio = ratio.masked_fill((ratio < (low if low is not None else -math.inf))
                                  | (ratio > (high if high is not None else math.inf)), 0.0)
    return {**inputs, "old_per_token_logps": old, "importance_sampling_ratio": ratio}


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("data", ["on-policy", "off-policy"])
def test_the_sampler_correction_equals_trls_with_vllm(pair, mode, data):
    """TRL's vLLM importance-sampling correction (on by default) applies to Arctic's sampler: the
    loss and gradients equal plain TRL's when vLLM sampled, for every loss type and mode (TRL's
    VESPO takes the token modes), and the sampling metrics are TRL's over the micro-batch."""
    plain, inputs, arctic = pair
    sampled = off_policy(plain, inputs, sampler=True)
    if data == "on-policy":  # the sampler's log-probs, the weights that sampled unchanged
        sampled = {**sampled, "old_per_token_logps": None}
    for loss_type in LOSS_TYPES:
        if loss_type == "vespo" and mode.startswith("sequence"):
            continue
        settings = dict(loss_type=loss_type, importance_sampling_level="token", beta=0.0, delta=None,
                        top_entropy_quantile=1.0, epsilon_high=1.2 if loss_type == "cispo" else 0.28,
                        off_policy_mask_threshold=None, vllm_importance_sampling_correction=True,
                        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5,
                        vllm_importance_sampling_clip_max=1.5)
        configure(plain, **settings)
        configure(arctic, **settings)
        plain.use_vllm, plain.vllm_importance_sampling_correction = True, True
        try:
            expected, expected_grads = plain_loss_and_grads(plain, trl_vllm_importance_sampling(plain, sampled))
        finally:
            plain.use_vllm = False
        metrics = arctic.arctic_fwd_bwd(sampled)
        case = f"{loss_type} {mode} {data}"
        assert metrics["loss"] == pytest.approx(expected, abs=1e-5), case
        assert_grads_equal(take_arctic_grads(arctic), expected_grads, case)
        assert_sampling_metrics_equal(plain, trl_vllm_importance_sampling(plain, sampled), arctic, metrics, case)


def assert_sampling_metrics_equal(plain, prepared: dict, arctic, metrics: dict, case: str) -> None:
    """TRL's sampling/* metrics (its generation step's formulas) over this micro-batch."""
    mask = prepared["completion_mask"].bool()
    delta = (prepared["old_per_token_logps"] - prepared["sampling_per_token_logps"]).abs()[mask]
    ratio = prepared["importance_sampling_ratio"]
    ratio = ratio.flatten() if ratio.shape[1] == 1 else ratio[mask]
    expected = {"sampling/sampling_logp_difference/mean": delta.mean(),
                "sampling/sampling_logp_difference/max": delta.max(),
                "sampling/importance_sampling_ratio/min": ratio.min(),
                "sampling/importance_sampling_ratio/mean": ratio.mean(),
                "sampling/importance_sampling_ratio/max": ratio.max()}
    before = metric_counts(arctic)
    arctic._record_as_trl(metrics)
    ours = {k: v[-1] for k, v in arctic._metrics["train"].items()
            if k.startswith("sampling/") and len(v) > before.get(k, 0)}
    assert ours.keys() == expected.keys(), case
    for name, value in expected.items():
        assert ours[name] == pytest.approx(float(value), abs=1e-5), (case, name)


def metric_counts(trainer) -> dict[str, int]:
    return {name: len(values) for name, values in trainer._metrics["train"].items()}


def assert_trl_metrics_equal(plain, logged: dict[str, int], arctic, metrics: dict, loss_type: str, beta: float,
                             case: str) -> None:
    """The loss metrics Arctic logs under TRL's names equal those plain TRL's call just logged."""
    expected = {k: v[-1] for k, v in plain._metrics["train"].items() if len(v) > logged.get(k, 0)}
    before = metric_counts(arctic)
    arctic._record_as_trl(metrics)
    ours = {k: v[-1] for k, v in arctic._metrics["train"].items() if len(v) > before.get(k, 0)}
    named = {"cispo": {"cispo_clip_ratio"}, "vespo": {"vespo/phi_seq_mean"}}.get(loss_type, set())
    if AGGREGATION_CLIPPED(loss_type):
        named = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max"}
    named |= {"entropy"} | ({"kl"} if beta else set()) | ({"policy_loss"} if plain._entropy_bonus_enabled else set())
    assert named <= ours.keys() <= expected.keys(), case
    for name, value in ours.items():
        assert value == pytest.approx(expected[name], abs=1e-5), (case, name)


def AGGREGATION_CLIPPED(loss_type: str) -> bool:  # the loss types delta applies to
    return loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def test_trls_defaults_with_a_bias_corrected_kl_learn(tmp_path):
    """TRL's defaults (dapo, use_bias_correction_kl=True) with beta = 0.01: the reward rises."""
    history = trl_grpo.main(["--steps", "12", "--out", str(tmp_path), "--beta", "0.01"])
    rewards = [h["reward"] for h in history if "reward" in h]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
    assert any("arctic/kl/kl" in h for h in history)


def test_a_second_iteration_on_the_same_batch_equals_plain_trl(policy, tmp_path):
    """num_iterations=2: after one optimizer step the batch is trained on again with the old
    log-probs of before the step, so every ratio differs from 1; Arctic's loss and gradients equal
    plain TRL's on that second pass, so both took the same first step (weight decay included, which
    Hugging Face's Trainer does not apply to biases and norm weights). Adam's first step is
    lr * g / (|g| + eps): with the default eps (1e-8) a weight whose gradient is within rounding of 0
    moves by +lr or -lr as that rounding falls, so eps is larger here (and reaches the backend)."""
    settings = dict(num_iterations=2, max_grad_norm=0.0, learning_rate=1e-2, beta=0.04, loss_type="grpo",
                    epsilon_high=0.28, delta=1.5, weight_decay=0.1, adam_epsilon=1e-4)
    plain, inputs, arctic = plain_and_arctic(policy, tmp_path, **settings)
    assert inputs["old_per_token_logps"] is not None  # TRL computed them: the data goes off-policy
    optimizer = plain.create_optimizer()  # Hugging Face's AdamW: no weight decay for biases and norm weights
    for iteration in range(2):
        expected, expected_grads = plain_loss_and_grads(plain, inputs)
        metrics = arctic.arctic_fwd_bwd(inputs)
        assert metrics["loss"] == pytest.approx(expected, abs=1e-5), iteration
        assert_grads_equal(arctic.arctic.transport.server.trainer.full_gradients(), expected_grads, iteration)
        optimizer.step()
        arctic.arctic.step(lr=1e-2)
    assert metrics["ppo/clipfrac"] > 0  # the second pass really was off-policy
    arctic.arctic.close()


def test_the_adaptive_entropy_bonus_follows_trls_controller(policy, tmp_path):
    """use_adaptive_entropy: no bonus until the first measurement; then the coefficient moves by
    entropy_coef_delta towards entropy_target, and Arctic's loss, gradients and controller state
    equal TRL's call after call (with entropy masking too)."""
    settings = dict(use_adaptive_entropy=True, entropy_target=10.0, entropy_coef_delta=0.05, loss_type="grpo",
                    top_entropy_quantile=0.5)
    plain, inputs, arctic = plain_and_arctic(policy, tmp_path, **settings)
    for call in range(3):
        logged = metric_counts(plain)
        expected, expected_grads = plain_loss_and_grads(plain, inputs)
        metrics = arctic.arctic_fwd_bwd(inputs)
        assert metrics["loss"] == pytest.approx(expected, abs=1e-5), call
        assert_grads_equal(take_arctic_grads(arctic), expected_grads, call)
        assert arctic.entropy_coef == pytest.approx(plain.entropy_coef) == pytest.approx(0.05 * (call + 1))
        assert arctic._last_world_entropy == pytest.approx(plain._last_world_entropy, rel=1e-5)
        assert_trl_metrics_equal(plain, logged, arctic, metrics, "grpo", 0.0, call)
        # TRL's policy_loss leaves the bonus out: none on the first call, applied from the second on
        bonus = metrics["loss"] - arctic._policy_loss / arctic.current_gradient_accumulation_steps
        assert (bonus != pytest.approx(0.0, abs=1e-6)) == (call > 0), (call, bonus)
    arctic.arctic.close()


def test_trls_training_settings_reach_the_backend(policy, tmp_path):
    """Conversational prompts, two reward functions with weights, steps_per_generation and
    num_iterations > 1, sampling and optimizer settings: TRL trains through Arctic with them."""
    conversations = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in DATASET["prompt"]]})

    def length_reward(completion_ids, **kwargs) -> list[float]:
        return [len(ids) / 8 for ids in completion_ids]

    args = grpo_args(tmp_path, max_steps=4, steps_per_generation=2, num_iterations=2, top_p=0.9, top_k=20,
                     min_p=0.05, repetition_penalty=1.1, weight_decay=0.01, max_grad_norm=0.5, beta=0.01,
                     reward_weights=[1.0, 0.5], generation_kwargs={"temperature": 0.9})
    trainer = GRPOTrainer(model=policy, reward_funcs=[variety_reward, length_reward], args=args,
                          train_dataset=conversations)
    server, calls = trainer.arctic.transport.server, []
    generate = trainer.arctic.generate
    trainer.arctic.generate = lambda prompts, **kw: calls.append((prompts, kw)) or generate(prompts, **kw)
    trainer.train()
    assert server.step_count == 4 and len(calls) == 1  # one generation serves 2 steps x 2 iterations
    prompts, params = calls[0]
    assert all(p[:1] == [trainer.processing_class.convert_tokens_to_ids("<|im_start|>")]
               for p in prompts)  # chat template
    assert {k: params[k] for k in ("top_p", "top_k", "min_p", "repetition_penalty", "temperature")} == \
        {"top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "temperature": 0.9}
    optimizer = server.config.trainer.optimizer
    assert optimizer.weight_decay == 0.01 and optimizer.max_grad_norm == 0.5 and server.reference is not None
    logged = {key for h in trainer.state.log_history for key in h}
    assert {"rewards/variety_reward/mean", "rewards/length_reward/mean", "arctic/kl/kl"} <= logged
    trainer.arctic.close()


def test_trls_gradient_checkpointing_recomputes_only_the_layers_memory_cannot_keep(tmp_path):
    """TRL's gradient_checkpointing=True (its default) becomes checkpoint_layers: auto (the same
    gradients; fewer layers recomputed where the free GPU memory keeps them); arctic= still wins."""
    checkpointed = grpo_args(tmp_path, gradient_checkpointing=True)
    assert ArcticConfig.from_dict(arctic_config("m", checkpointed)).trainer.checkpoint_layers == "auto"
    pinned = arctic_config("m", checkpointed, {"trainer": {"checkpoint_layers": None}})
    assert ArcticConfig.from_dict(pinned).trainer.checkpoint_layers is None
    assert ArcticConfig.from_dict(arctic_config("m", grpo_args(tmp_path))).trainer.checkpoint_layers is None


def test_bf16_on_one_process_trains_with_deepspeeds_bf16_optimizer_unless_told_otherwise(tmp_path):
    """bf16 in one process: DeepSpeed ZeRO stage 1, whose bf16 optimizer steps sooner with the same
    fp32 accumulation; not with colocated engines (it cannot sleep), another trainer backend, the
    user's own trainer options, or in fp32."""
    bf16 = grpo_args(tmp_path, bf16=True)

    def options(args, overrides=None) -> dict:
        return ArcticConfig.from_dict(arctic_config("m", args, overrides)).trainer.options

    assert options(bf16) == {"zero_stage": 1}
    assert options(bf16, {"colocate": True}) == {}
    assert options(bf16, {"trainer": {"options": {"zero_stage": 3}}}) == {"zero_stage": 3}
    assert options(bf16, {"trainer": {"backend": "torch"}}) == {}
    assert options(grpo_args(tmp_path)) == {}


def test_unsupported_settings_fail_clearly(policy, tmp_path):
    args = grpo_args(tmp_path, generation_kwargs={"top_p": 0.9, "typical_p": 0.5, "no_repeat_ngram_size": 2})
    with pytest.raises(ValueError, match=r"generation_kwargs \['no_repeat_ngram_size', 'typical_p'\]"):
        GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=DATASET)


def test_use_vllm_samples_on_arctics_sampler_with_the_same_results_as_without(policy, tmp_path, caplog):
    """A TRL script with use_vllm=True runs as it is: Arctic's sampler generates in vLLM's place
    (TRL starts no vLLM), with the samples and updates of the same script without use_vllm; in
    colocate mode vllm_gpu_memory_utilization reaches the sampler's options, and server mode (no
    server needed) says so in one notice."""
    runs = {"without": {}, "colocate": dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.5),
            "server": dict(use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.2")}
    results, notices = {}, {}
    for name, settings in runs.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="arctic_trl"):
            trainer = GRPOTrainer(model=policy, reward_funcs=variety_reward, train_dataset=DATASET,
                                  args=grpo_args(tmp_path / name, max_steps=2, **settings))
            trainer.train()
        notices[name] = [r.getMessage() for r in caplog.records if r.name.startswith("arctic_trl")]
        logged = [h[key] for h in trainer.state.log_history if "loss" in h for key in ("loss", "reward", "grad_norm")]
        results[name] = logged, weights(trainer.arctic)
        assert len(logged) == 6 and not hasattr(trainer, "vllm_generation"), name
        if name == "colocate":
            assert trainer.arctic.transport.server.config.sampler.options == {"gpu_memory_utilization": 0.5}
        trainer.arctic.close()
    for name in ("colocate", "server"):
        assert results[name][0] == pytest.approx(results["without"][0], rel=1e-5, abs=1e-9), name
        assert all(torch.allclose(v, results["without"][1][k], atol=1e-6) for k, v in results[name][1].items()), name
    assert notices["without"] == notices["colocate"] == []
    assert notices["server"] == ["arctic_trl: vllm_mode='server': Arctic's own sampler generates instead of a vLLM "
                                 "server (no `trl vllm-serve` needed), vllm_server_host unused"]


def test_trls_vllm_settings_become_the_samplers_options(tmp_path):
    """Colocate mode: vllm_gpu_memory_utilization and vllm_max_model_length set the sampler's
    options of those names (the embedded engine's or vLLM's, each checked by the backend's own
    options model), vllm_model_impl='transformers' its transformers' modules, and
    vllm_enable_sleep_mode Arctic's colocate. TRL's defaults (0.3: vLLM's share beside TRL's own
    trainer) leave the sampler's, arctic= options win, and server mode reads none of them (as TRL)."""
    from arctic_core.config import validate_options
    from arctic_fca.engine import EngineOptions
    from arctic_fca.vllm.sampler import VllmOptions

    def built(overrides=None, **settings) -> ArcticConfig:
        return ArcticConfig.from_dict(arctic_config("m", grpo_args(tmp_path, use_vllm=True, **settings), overrides))

    sized = dict(vllm_gpu_memory_utilization=0.5, vllm_max_model_length=256, vllm_model_impl="transformers")
    embedded = built(**sized).sampler
    assert embedded.options == {"gpu_memory_utilization": 0.5, "max_model_len": 256, "fused_decoder": False}
    validate_options(EngineOptions, embedded, "embedded")
    vllm = built({"sampler": {"backend": "vllm", "options": {"fca": False}}}, **sized).sampler
    assert vllm.options == {"gpu_memory_utilization": 0.5, "max_model_len": 256, "fca": False,
                            "engine_args": {"model_impl": "transformers"}}
    validate_options(VllmOptions, vllm, "vllm")
    assert built().sampler.options == {} and not built().colocate
    mine = built({"sampler": {"options": {"gpu_memory_utilization": 0.7}}}, vllm_gpu_memory_utilization=0.5)
    assert mine.sampler.options == {"gpu_memory_utilization": 0.7}
    assert built(vllm_mode="server", vllm_enable_sleep_mode=True, **sized).sampler.options == {}
    sleeping = built(vllm_enable_sleep_mode=True, bf16=True)
    assert sleeping.colocate and sleeping.trainer.options == {}  # not ZeRO stage 1, which cannot sleep
    # Where no option has the meaning, the notice names the setting.
    args = grpo_args(tmp_path, use_vllm=True, vllm_gpu_memory_utilization=0.5)
    assert vllm_notice(args, {}) is None
    assert vllm_notice(args, {"sampler": {"backend": "hf-generate"}}) == \
        "arctic_trl: vllm_gpu_memory_utilization not applied: the 'hf-generate' sampler has no such option"
    assert vllm_notice(args, None) == ("arctic_trl: vllm_gpu_memory_utilization not applied: the backend's sampler "
                                       "is configured where the backend runs")


def test_vllm_settings_arctics_samplers_cannot_honour_are_refused_by_name(policy, tmp_path):
    """Structured outputs and tensor parallelism are refused, each with its reason; every vllm_*
    setting of TRL's GRPOConfig has its row in the adapter's table."""
    args = grpo_args(tmp_path, use_vllm=True, vllm_structured_outputs_regex=r"\d+", vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError) as refused:
        GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=DATASET)
    for named in (r"vllm_structured_outputs_regex='\\d+': Arctic's samplers do not constrain decoding to a regex",
                  "vllm_tensor_parallel_size=2: Arctic's samplers do not shard a model over GPUs"):
        assert named in str(refused.value)
    assert unsupported(grpo_args(tmp_path, use_vllm=True, vllm_mode="remote")) == [
        "vllm_mode='remote' (TRL's: colocate, server)"]
    assert {f.name for f in dataclasses.fields(trl.GRPOConfig) if f.name.startswith("vllm_")} == set(VLLM_SETTINGS)


def test_a_hub_model_id_is_fetched_into_the_hub_cache_for_the_backend(hub_cache, tmp_path):
    assert _model_folder("arctic-test/tiny-policy") == str(hub_cache)
    with pytest.raises(ValueError, match="GRPOTrainer's model: nothing is at 'arctic-test/absent' here, "
                                         "and fetching it"):
        GRPOTrainer(model="arctic-test/absent", reward_funcs=variety_reward, args=grpo_args(tmp_path),
                    train_dataset=DATASET)


TWO_PROCESSES = """
import os
import sys
from pathlib import Path

import trl
from datasets import Dataset
from arctic_trl import GRPOTrainer

args = trl.GRPOConfig(output_dir=sys.argv[2], max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, report_to="none", use_cpu=True, bf16=False, save_strategy="no")
try:
    GRPOTrainer(model=sys.argv[1], reward_funcs=lambda completion_ids, **k: [0.0] * len(completion_ids), args=args,
                train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}))
except ValueError as error:  # one file per process: their printed lines can interleave
    Path(sys.argv[2], f"refused-{os.environ['RANK']}.txt").write_text(str(error))
"""


def test_several_trl_processes_are_refused_with_what_to_run_instead(policy, tmp_path):
    """Under torchrun every process would start a backend of its own (or step a shared one once per
    process): each of TRL's two processes refuses before any engine starts."""
    script = tmp_path / "two_processes.py"
    script.write_text(TWO_PROCESSES)
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), policy, str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    refusals = [(tmp_path / f"refused-{rank}.txt") for rank in (0, 1)]
    assert run.returncode == 0 and all(file.is_file() for file in refusals), run.stdout + run.stderr
    assert all("2 processes: run TRL as one process" in file.read_text() for file in refusals)


def test_checkpoints_hold_the_trained_policy_and_resuming_restores_the_backend(policy, tmp_path):
    args = grpo_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=DATASET)
    trainer.train()
    trained = weights(trainer.arctic)
    checkpoint = tmp_path / "checkpoint-2"
    # TRL's checkpoint folder loads as the trained policy (the placeholder model is never saved).
    saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    assert saved.keys() <= trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)
    trainer.arctic.close()

    resumed = GRPOTrainer(model=policy, reward_funcs=variety_reward, args=grpo_args(tmp_path, max_steps=3),
                          train_dataset=DATASET)
    assert any(not torch.equal(v, trained[k]) for k, v in weights(resumed.arctic).items())  # the initial policy
    resumed.train(resume_from_checkpoint=str(checkpoint))
    # The backend continued from the checkpoint's weights, optimizer and step count (2), with TRL.
    assert resumed.state.global_step == 3 and resumed.arctic.status().step == 3
    resumed.arctic.close()


class RecordingTrainer(GRPOTrainer):
    """Keeps each generation call's completions, by the optimizer step it served."""

    def _generate_single_turn(self, *args, **kwargs):
        completions, logprobs = super()._generate_single_turn(*args, **kwargs)
        self.sampled = {**getattr(self, "sampled", {}), self.state.global_step: completions}
        return completions, logprobs


def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_run(policy, tmp_path):
    """Resuming from checkpoint-2 and running step 3 gives the uninterrupted run's step 3: the same
    sampling seed (from the restored step), so the same completions and loss."""
    full = RecordingTrainer(model=policy, reward_funcs=variety_reward, train_dataset=DATASET,
                            args=grpo_args(tmp_path / "full", max_steps=3, save_strategy="steps", save_steps=1))
    full.train()
    full.arctic.close()
    resumed = RecordingTrainer(model=policy, reward_funcs=variety_reward, train_dataset=DATASET,
                               args=grpo_args(tmp_path / "resumed", max_steps=3))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    resumed.arctic.close()
    assert list(resumed.sampled) == [2] and resumed.sampled[2] == full.sampled[2]
    assert full.sampled[2] != full.sampled[1]

    def step_3(trainer) -> dict:
        return next(h for h in trainer.state.log_history if h.get("step") == 3 and "loss" in h)

    assert step_3(resumed)["loss"] == pytest.approx(step_3(full)["loss"], abs=1e-6)


def test_trl_settings_arctic_does_not_compute_are_refused_by_name(policy, tmp_path):
    args = grpo_args(tmp_path, optim="adafactor", cast_lm_head_to_fp32=True, sync_ref_model=True, beta=0.1)
    with pytest.raises(ValueError) as refused:
        GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=DATASET)
    for named in ("optim='adafactor'", "cast_lm_head_to_fp32", "sync_ref_model"):
        assert named in str(refused.value)
    # Values TRL checks only when it first computes a loss, and lengths past the model's positions.
    args = grpo_args(tmp_path, importance_sampling_level="seq", vllm_importance_sampling_mode="tok",
                     max_completion_length=512)
    with pytest.raises(ValueError) as refused:
        GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=DATASET)
    for named in ("importance_sampling_level='seq' (TRL's: token, sequence)",
                  "vllm_importance_sampling_mode='tok' (TRL's: token_truncate,",
                  "max_completion_length=512 leaves no room for a prompt in the model's max_position_embeddings=512"):
        assert named in str(refused.value)
    # Three micro-batches per generation, two per optimizer step: keeping a prompt's samples together
    # would move rows from one step into the next, so the regrouping is off.
    assert not regroup_is_exact(grpo_args(tmp_path, steps_per_generation=3, gradient_accumulation_steps=2))
    assert regroup_is_exact(grpo_args(tmp_path, steps_per_generation=4, gradient_accumulation_steps=2))


def test_truncated_sampling_under_trls_default_correction_is_warned_about(policy, tmp_path):
    """top-k / top-p / min-p with TRL's vLLM correction (on by default) down-weights every sample, as
    TRL with vLLM does: the trainer says so when it is built, and not without the correction."""
    with pytest.warns(UserWarning, match="top_k=5, top_p=0.9 with vllm_importance_sampling_correction"):
        trainer = GRPOTrainer(model=policy, reward_funcs=variety_reward, train_dataset=DATASET,
                              args=grpo_args(tmp_path, top_k=5, top_p=0.9))
    trainer.arctic.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        # accelerate's own, when its state starts afresh without OMP_NUM_THREADS set
        warnings.filterwarnings("ignore", "OMP_NUM_THREADS/MKL_NUM_THREADS unset", UserWarning)
        trainer = GRPOTrainer(model=policy, reward_funcs=variety_reward, train_dataset=DATASET,
                              args=grpo_args(tmp_path, top_k=5, vllm_importance_sampling_correction=False))
    trainer.arctic.close()


def test_a_model_with_dropout_needs_trls_disable_dropout(policy, tmp_path):
    """TRL trains with the model's dropout unless disable_dropout; Arctic never applies dropout."""
    folder = tmp_path / "with-dropout"
    shutil.copytree(policy, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    with pytest.raises(ValueError, match=r"dropout \{'attention_dropout': 0.1\}.*set disable_dropout=True"):
        GRPOTrainer(model=str(folder), reward_funcs=variety_reward, args=grpo_args(tmp_path), train_dataset=DATASET)
    trainer = GRPOTrainer(model=str(folder), reward_funcs=variety_reward,
                          args=grpo_args(tmp_path, disable_dropout=True), train_dataset=DATASET)
    trainer.arctic.close()


def test_no_full_model_on_the_client(policy, tmp_path):
    trainer = GRPOTrainer(model=policy, reward_funcs=variety_reward, args=grpo_args(tmp_path), train_dataset=DATASET)
    assert sum(p.numel() for p in trainer.model.parameters()) == 1  # the placeholder only
    assert trainer.ref_model is None
    with pytest.raises(RuntimeError, match="runs in the Arctic backend"):
        trainer.model(torch.zeros(1, 2, dtype=torch.long))
    trainer.arctic.close()


def test_trl_over_http_drives_a_served_backend_with_trls_schedule(policy, tmp_path):
    """The same trainer against ``arctic-rl serve``'s app on loopback: every step reaches the
    server at the learning rate of TRL's (linear) schedule, and the sampler follows each step."""
    from test_http import LiveServer

    from arctic_core.config import ArcticConfig
    from arctic_core.serving.http import create_app
    from arctic_core.serving.server import ArcticServer

    server = ArcticServer(ArcticConfig.from_dict({"model": {"path": policy, "device": "cpu"}, "seed": 0}))
    live = LiveServer(create_app(server))
    try:
        args = grpo_args(tmp_path, max_steps=3, lr_scheduler_type="linear", gradient_checkpointing=True)
        trainer = GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=DATASET,
                              arctic=live.url)
        trainer.train()
    finally:
        live.stop()
    assert server.step_count == 3 and server.policy_version == 3
    lrs = [h["arctic/step/lr"] for h in trainer.state.log_history if "arctic/step/lr" in h]
    assert lrs == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3], rel=1e-6)


@pytest.mark.parametrize("nan_filter", [True, False])
def test_a_nan_loss_is_logged_as_the_trainers_filter_says(policy, tmp_path, nan_filter):
    """transformers' ``logging_nan_inf_filter`` (applied by the adapter from the backend's loss
    value, without reading a device tensor): a NaN micro-batch loss counts as the mean of the
    losses since the last log; without the filter the logged loss is NaN."""
    args = grpo_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                     logging_nan_inf_filter=nan_filter)
    def by_place(completion_ids, **kwargs) -> list[float]:  # unequal within every group, whatever was sampled
        return [float(i % 3) for i in range(len(completion_ids))]

    trainer = GRPOTrainer(model=policy, reward_funcs=by_place, args=args, train_dataset=DATASET)
    losses, fwd_bwd = [], trainer.arctic.fwd_bwd

    def second_is_nan(*call, **kwargs):
        metrics = dict(fwd_bwd(*call, **kwargs).metrics)
        losses.append(metrics["loss"] if not losses else float("nan"))
        return SimpleNamespace(metrics={**metrics, "loss": losses[-1]})

    trainer.arctic.fwd_bwd = second_is_nan
    trainer.train()
    trainer.arctic.close()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and losses[0] != 0.0
    assert logged == ([pytest.approx(2 * losses[0], abs=1e-4)] if nan_filter
                      else [pytest.approx(float("nan"), nan_ok=True)])


def test_micro_batches_keep_prompt_groups_together_with_the_same_gradient(policy, tmp_path):
    """TRL shuffles rows across an optimizer step's micro-batches; arctic_trl regroups them so
    each micro-batch packs one prompt, and the step's summed gradient is unchanged (dapo)."""
    args = grpo_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
    distinct = Dataset.from_dict({"prompt": DATASET["prompt"][:4]})
    plain = trl.GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=distinct)
    plain.model.train()
    plain._prepare_inputs(next(iter(plain.get_train_dataloader())))
    first, second = plain._buffered_inputs  # two prompts x 4 samples, in TRL's shuffled order

    def mix(a: dict, b: dict) -> dict:  # two rows of each micro-batch
        return {k: (torch.cat([a[k][:2], b[k][:2]]) if isinstance(v, torch.Tensor) else a[k][:2] + b[k][:2])
                if isinstance(v, list) or (isinstance(v, torch.Tensor) and v.ndim) else v for k, v in a.items()}

    by_prompt = group_micro_batches([first, second], window=2)
    assert all(len({tuple(p.tolist()) for p in b["prompt_ids"]}) == 1 for b in by_prompt)
    rest = [{k: v[2:] if isinstance(v, list) or (isinstance(v, torch.Tensor) and v.ndim) else v for k, v in b.items()}
            for b in by_prompt]
    shuffled = [mix(*by_prompt), mix(*rest)]
    assert all(len({tuple(p.tolist()) for p in b["prompt_ids"]}) == 2 for b in shuffled)
    grouped = group_micro_batches(shuffled, window=2)
    assert all(len({tuple(p.tolist()) for p in b["prompt_ids"]}) == 1 for b in grouped)

    gradients = []
    for batches in (shuffled, grouped):
        arctic = GRPOTrainer(model=policy, reward_funcs=variety_reward, args=args, train_dataset=distinct)
        arctic.current_gradient_accumulation_steps = 2
        for batch in batches:
            arctic.arctic_fwd_bwd(batch)
        gradients.append(arctic.arctic.transport.server.trainer.full_gradients())
        arctic.arctic.close()
    for name, grad in gradients[0].items():
        assert grad.norm() > 0
        assert (gradients[1][name] - grad).norm() <= 1e-4 * grad.norm(), name
