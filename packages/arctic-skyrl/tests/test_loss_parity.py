"""One PPO mini-batch: Arctic's loss and gradients equal SkyRL's own policy worker's (fp32, CPU).

SkyRL's side runs its real functions as its policy worker combines them
(``PolicyWorkerBase._forward_backward_micro``): advantages scaled by the trainer's loss reduction
(``apply_loss_reduction_to_advantages_minibatch``), the policy loss of ``policy_loss_type``, the KL
loss (``compute_approx_kl``, a mean of per-sequence means) and the entropy bonus (a token mean per
micro-batch), on the log-probs of a plain forward of the same model. Arctic's side is
arctic-skyrl's dispatch on the same padded batch, with shared prompts packed once.
"""

from __future__ import annotations

import math

import pytest
import torch
from skyrl.backends.skyrl_train.distributed.dispatch import loss_fn_outputs_to_tensor
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.utils import ppo_utils
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
from transformers import AutoModelForCausalLM

from arctic_core.adapters.settings import BackendSettings
from arctic_core.client import ArcticClient
from arctic_skyrl.dispatch import ArcticDispatch
from arctic_skyrl.mapping import arctic_config, entropy_is_exact, refusals, sampler_correction

ALGO = "trainer.algorithm."
CASES = {
    "regular-token-mean-k3": ["kl_loss_coef=0.1", "kl_estimator_type=k3"],
    "dual-clip-sequence-mean-k1-entropy-per-row": ["policy_loss_type=dual_clip", "clip_ratio_c=1.5",
                                                   "loss_reduction=sequence_mean", "kl_estimator_type=k1",
                                                   "use_entropy_loss=true", "entropy_loss_coef=0.05"],
    "gspo-sequence-mean": ["policy_loss_type=gspo", "loss_reduction=sequence_mean", "eps_clip_low=0.0003",
                           "eps_clip_high=0.0004", "use_kl_loss=false"],
    "sapo-dr-grpo-k2-temperature": ["policy_loss_type=sapo", "loss_reduction=seq_mean_token_sum_norm",
                                    "max_seq_len=12", "kl_estimator_type=k2", "temperature=0.7"],
    "cispo-prompt-mean-abs-entropy-one-micro-batch": ["policy_loss_type=cispo", "loss_reduction=prompt_mean",
                                                      "kl_estimator_type=abs", "use_entropy_loss=true",
                                                      "cispo.cispo_eps_clip_high=0.2", "cispo.cispo_eps_clip_low=0.2"],
    "regular-token-mean-legacy": ["loss_reduction=token_mean_legacy", "eps_clip_high=0.28"],
    "regular-token-tis": ["off_policy_correction.tis_ratio_type=token",
                          "off_policy_correction.token_tis_ratio_clip_high=1.5"],
    "gspo-sequence-tis": ["policy_loss_type=gspo", "loss_reduction=sequence_mean", "eps_clip_low=0.0003",
                          "eps_clip_high=0.0004", "use_kl_loss=false", "off_policy_correction.tis_ratio_type=sequence",
                          "off_policy_correction.sequence_tis_ratio_clip_high=2.0"],
    "gspo-token-tis": ["policy_loss_type=gspo", "eps_clip_low=0.0003", "eps_clip_high=0.0004", "use_kl_loss=false",
                       "off_policy_correction.tis_ratio_type=token",
                       "off_policy_correction.token_tis_ratio_clip_high=1.2"],
    # SkyRL's masks: a rejected token or sequence weighs 0 and stays in the loss reduction
    "regular-token-tis-outlier-and-token-masks": ["off_policy_correction.tis_ratio_type=token",
                                                  "off_policy_correction.outlier_token_is_threshold_high=2.0",
                                                  "off_policy_correction.token_mask_is_threshold_low=0.8",
                                                  "off_policy_correction.token_mask_is_threshold_high=1.25"],
    "gspo-sequence-tis-geometric-mask": ["policy_loss_type=gspo", "loss_reduction=sequence_mean",
                                         "eps_clip_low=0.0003", "eps_clip_high=0.0004", "use_kl_loss=false",
                                         "off_policy_correction.tis_ratio_type=sequence",
                                         "off_policy_correction.token_mask_is_threshold_low=0.7",
                                         "off_policy_correction.token_mask_is_threshold_high=1.4",
                                         "off_policy_correction.sequence_mask_metric=geometric",
                                         "off_policy_correction.geo_mask_low=0.95",
                                         "off_policy_correction.geo_mask_high=1.05"],
    "cispo-product-mask": ["policy_loss_type=cispo", "off_policy_correction.sequence_mask_metric=product",
                           "off_policy_correction.product_mask_low=0.5", "off_policy_correction.product_mask_high=2.0"],
}
MICRO_BATCH = {"cispo-prompt-mean-abs-entropy-one-micro-batch": 8, "regular-token-mean-legacy": 2}
POLICY_LOSSES = {"regular": ppo_utils.ppo_policy_loss, "dual_clip": ppo_utils.ppo_policy_loss,
                 "gspo": ppo_utils.gspo_policy_loss, "sapo": ppo_utils.sapo_policy_loss,
                 "cispo": ppo_utils.compute_policy_loss_cispo}
PROMPTS = [[5, 9, 13, 17, 21], [7, 8]]
RESPONSES = [[30, 31, 32, 33], [40, 41, 42, 43, 44, 45, 46], [50, 51], [60, 61, 62, 63, 64], [70, 71, 72]]
PROMPT_OF = [0, 0, 0, 1, 1]


def skyrl_config(policy, case: str) -> SkyRLTrainConfig:
    micro = MICRO_BATCH.get(case, 1)
    return SkyRLTrainConfig.from_cli_overrides([
        f"trainer.policy.model.path={policy}", "trainer.policy.optimizer_config.lr=1e-3",
        f"trainer.micro_train_batch_size_per_gpu={micro}", "trainer.policy_mini_batch_size=2",
        "generator.n_samples_per_prompt=3", *(ALGO + item for item in CASES[case])])


def batch_tensors(model, temperature: float) -> dict[str, torch.Tensor]:
    """SkyRL's padded batch: sequences, masks (one masked token) and right-aligned per-token
    log-probs and entropies of the model; old and reference log-probs perturbed so that the clips
    and the KL act; advantages of both signs."""
    prompts = [PROMPTS[p] for p in PROMPT_OF]
    loss_masks = [[1] * len(r) for r in RESPONSES]
    loss_masks[1][-1] = 0
    sequences, attention, response_mask, _, loss_mask, *_ = convert_prompts_responses_to_batch_tensors(
        0, prompts, RESPONSES, [[0.0] * len(r) for r in RESPONSES], loss_masks)
    width = response_mask.shape[1]
    logits = model(sequences, attention_mask=attention).logits[:, -width - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    log_probs = logp.gather(-1, sequences[:, -width:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    generator = torch.Generator().manual_seed(0)
    current = log_probs.detach()
    signs = torch.tensor([(-1.0) ** i * (0.5 + i / 4) for i in range(len(RESPONSES))])
    return {"sequences": sequences, "attention_mask": attention, "response_mask": response_mask,
            "loss_mask": loss_mask.float(), "log_probs": log_probs, "entropy": entropy,
            "old": (old := current + 0.6 * torch.randn(current.shape, generator=generator)),
            "ref": current + 0.4 * torch.randn(current.shape, generator=generator),
            "rollout": old + 0.3 * torch.randn(current.shape, generator=generator),
            "advantages": signs[:, None] * response_mask}


def scaled_advantages(cfg: SkyRLTrainConfig, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trainer's loss-reduction scaling (``_normalize_advantages``) for one mini-batch."""
    algorithm = cfg.trainer.algorithm
    return ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        t["advantages"], t["loss_mask"], algorithm.loss_reduction, cfg.trainer.micro_train_batch_size_per_gpu,
        algorithm.max_seq_len, prompt_boundaries=[(0, 3), (3, 5)])


def skyrl_loss_and_grads(policy, cfg: SkyRLTrainConfig) -> tuple[float, dict[str, torch.Tensor], float]:
    """The loss, gradients and ``policy_entropy`` metric (the mean of the micro-batches' entropies)."""
    algorithm = cfg.trainer.algorithm
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    t = batch_tensors(model, algorithm.temperature)
    advantages, rows, micro = scaled_advantages(cfg, t), len(RESPONSES), cfg.trainer.micro_train_batch_size_per_gpu
    total, entropies = torch.zeros(()), []
    for start in range(0, rows, micro):  # the worker's micro-batches, as _forward_backward_micro adds them
        part = slice(start, start + micro)
        mask = t["loss_mask"][part]
        policy_loss, _ = POLICY_LOSSES[algorithm.policy_loss_type](
            t["log_probs"][part], t["old"][part], advantages[part], config=algorithm, loss_mask=mask,
            rollout_logprobs=t["rollout"][part])
        regularisers = torch.zeros(())
        if algorithm.use_kl_loss:
            kl = ppo_utils.compute_approx_kl(t["log_probs"][part], t["ref"][part], loss_mask=mask,
                                             kl_estimator_type=algorithm.kl_estimator_type)
            regularisers = regularisers + masked_mean(kl, mask, dim=-1).mean() * algorithm.kl_loss_coef
        entropies.append(masked_mean(t["entropy"][part], mask))
        if algorithm.use_entropy_loss:
            regularisers = regularisers - entropies[-1] * algorithm.entropy_loss_coef
        total = total + policy_loss + regularisers * (mask.shape[0] / rows)
    total.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return total.item(), grads, torch.stack(entropies).mean().item()


def training_input(cfg: SkyRLTrainConfig, policy) -> TrainingInputBatch:
    """The mini-batch as SkyRL's trainer stages it for its workers."""
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        t = batch_tensors(model, cfg.trainer.algorithm.temperature)
    data = TrainingInputBatch({"sequences": t["sequences"], "attention_mask": t["attention_mask"],
                               "response_mask": t["response_mask"], "loss_mask": t["loss_mask"],
                               "action_log_probs": t["old"], "base_action_log_probs": t["ref"],
                               "rollout_logprobs": t["rollout"],
                               "advantages": scaled_advantages(cfg, t)})
    data.metadata = {"response_length": t["response_mask"].shape[1]}
    return data


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_equal_skyrl_policy_worker(policy, case):
    cfg = skyrl_config(policy, case)
    expected, expected_grads, entropy = skyrl_loss_and_grads(policy, cfg)

    settings = BackendSettings(config={"trainer": {"backend": "torch"}})
    with ArcticClient.in_process(arctic_config(cfg, settings, on_gpu=False)) as arctic:
        dispatch = ArcticDispatch(cfg, arctic, num_training_steps=10)
        metrics = dispatch.forward_backward("policy", training_input(cfg, policy)).metrics
        grads = arctic.transport.server.trainer.full_gradients()

    assert metrics["arctic/packed_tokens"] < metrics["arctic/tokens"]  # the shared prompts packed once
    assert metrics["final_loss"] == pytest.approx(expected, abs=1e-5), case
    if entropy_is_exact(cfg):  # micro-batches of one row, or one micro-batch
        assert metrics["policy_entropy"] == pytest.approx(entropy, abs=1e-5), case
    if cfg.trainer.algorithm.policy_loss_type in ("regular", "dual_clip", "gspo"):
        assert metrics["loss_metrics/clip_ratio"] > 0, metrics  # the batch exercises the clip
    if "mask" in case:  # the masks reject some of the batch's tokens, not all
        rejected = next(value for key, value in metrics.items() if key.endswith("/sampler_rejected"))
        assert 0 < rejected < 1, (case, rejected)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert (grad - expected_grads[name]).norm() <= 1e-4 * expected_grads[name].norm() + 1e-9, (case, name)


def test_forward_log_probs_line_up_with_skyrl_layout(policy):
    """The old/reference log-probs SkyRL reads: right-aligned under ``response_mask``, equal to the
    plain forward's; a forward-only batch (sequences and attention mask only, as SkyRL's trainer
    sends its workers) gives the same values at every response position."""
    cfg = skyrl_config(policy, "regular-token-mean-k3")
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        expected = batch_tensors(model, cfg.trainer.algorithm.temperature)["log_probs"]
    data = training_input(cfg, policy)
    forward_only = data.select(keys=["sequences", "attention_mask"], metadata_keys=["response_length"])
    settings = BackendSettings(config={"trainer": {"backend": "torch"}})
    with ArcticClient.in_process(arctic_config(cfg, settings, on_gpu=False)) as arctic:
        dispatch = ArcticDispatch(cfg, arctic, num_training_steps=10)
        full = dispatch.log_probs(data, ("policy",))["policy"]
        windowed = loss_fn_outputs_to_tensor(dispatch.forward("policy", forward_only).loss_fn_outputs)
    mask = data["response_mask"].bool()
    assert full.shape == windowed.shape == expected.shape
    assert torch.allclose(full[mask], expected[mask], atol=1e-5)
    assert torch.allclose(windowed[mask], expected[mask], atol=1e-5)
    assert not full[~mask].any()  # nothing outside the responses


def test_a_step_skipped_over_a_non_finite_gradient_holds_skyrls_schedule(policy):
    """SkyRL returns before its scheduler steps when the gradient norm is not finite; Arctic skips
    such a step too, and the adapter's schedule must not move on."""
    cfg = skyrl_config(policy, "regular-token-mean-k3")
    settings = BackendSettings(config={"trainer": {"backend": "torch"}})
    with ArcticClient.in_process(arctic_config(cfg, settings, on_gpu=False)) as arctic:
        dispatch = ArcticDispatch(cfg, arctic, num_training_steps=10)
        param = next(arctic.transport.server.trainer.model.parameters())
        hook = param.register_hook(lambda grad: grad * float("nan"))
        dispatch.forward_backward("policy", training_input(cfg, policy))
        hook.remove()
        assert not math.isfinite(dispatch.optim_step("policy")) and dispatch.optimizer_steps == 0
        dispatch.forward_backward("policy", training_input(cfg, policy))
        assert math.isfinite(dispatch.optim_step("policy")) and dispatch.optimizer_steps == 1


def test_skyrl_settings_without_an_arctic_meaning_are_mapped_or_refused(policy):
    cfg = SkyRLTrainConfig.from_cli_overrides([f"trainer.policy.model.path={policy}",
                                               "trainer.policy.optimizer_config.max_grad_norm=0"])
    settings = BackendSettings()
    assert arctic_config(cfg, settings, on_gpu=False).trainer.optimizer.max_grad_norm is None  # SkyRL: <= 0 is off
    cfg.trainer.policy.model_config_kwargs = {"attention_dropout": 0.1}
    assert any(line.startswith("trainer.policy.model_config_kwargs=") for line in refusals(cfg, settings))
    # Off-policy correction: TIS weights and masks are the sampler correction (a token mask needs both
    # bounds in SkyRL, else it does nothing).
    correction = cfg.trainer.algorithm.off_policy_correction
    correction.sequence_mask_metric, correction.token_mask_is_threshold_high = "product", 2.0
    assert sampler_correction(cfg) == {"mode": "none", "reject_sequences": {"low": 0.5, "high": 2.0}}
    correction.sequence_mask_metric = None
    cfg.trainer.algorithm.use_tis, cfg.trainer.algorithm.tis_imp_ratio_cap = True, 3.0  # SkyRL's deprecated form
    assert sampler_correction(cfg) == {"mode": "token-truncate", "high": 3.0}
    cfg.trainer.algorithm.tis_imp_ratio_cap = -1.0
    assert any(line.startswith("trainer.algorithm.tis_imp_ratio_cap=-1.0") for line in refusals(cfg, settings))
