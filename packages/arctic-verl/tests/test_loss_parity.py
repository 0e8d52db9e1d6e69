"""One PPO mini-batch: Arctic's loss and gradients equal verl's own ``ppo_loss`` (fp32, CPU).

verl's side runs its real loss function (``verl.workers.utils.losses.ppo_loss``: policy loss by
``loss_mode``, entropy bonus, KL loss, ``agg_loss`` over the mini-batch) on the log-probs of a
plain forward of the same model. Arctic's side runs the terms arctic-verl maps verl's actor config
to, on the batch arctic-verl builds from verl's jagged rows (shared prompts packed once).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM
from verl.protocol import DataProto
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import response_to_nested

from arctic_core.client import ArcticClient
from arctic_verl.data import to_rollout_batch
from arctic_verl.mapping import arctic_config, loss_terms, sampler_correction
from arctic_verl.settings import ArcticSettings
from verl_run import verl_config

ACTOR = "actor_rollout_ref.actor."
CASES = {
    "vanilla-k3-token-mean": ["actor.use_kl_loss=True", "actor.kl_loss_type=low_var_kl", "actor.kl_loss_coef=0.1"],
    "vanilla-dual-clip-entropy-token-sum": ["actor.loss_agg_mode=token-sum", "actor.clip_ratio_c=1.5",
                                            "actor.entropy_coeff=0.01", "actor.clip_ratio_high=0.28"],
    "gspo-seq-mean-token-mean": ["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean",
                                 "actor.clip_ratio_low=0.0003", "actor.clip_ratio_high=0.0004"],
    "cispo-k1-seq-mean-token-sum": ["actor.policy_loss.loss_mode=cispo", "actor.loss_agg_mode=seq-mean-token-sum",
                                    "actor.use_kl_loss=True", "actor.kl_loss_type=k1"],
    "sapo-temperature": ["actor.policy_loss.loss_mode=sapo", "rollout.temperature=0.7"],
    "gpg-k2-abs": ["actor.policy_loss.loss_mode=gpg", "actor.use_kl_loss=True", "actor.kl_loss_type=abs"],
    "vanilla-k3+-token-sum-norm": ["actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=12",
                                   "actor.use_kl_loss=True", "actor.kl_loss_type=k3+", "actor.entropy_coeff=0.02"],
    "vanilla-mse": ["actor.use_kl_loss=True", "actor.kl_loss_type=mse", "actor.kl_loss_coef=0.5"],
    "vanilla-rollout-is-token-tis": ["rollout.calculate_log_probs=True"],
    "cispo-rollout-is-sequence-icepop": ["actor.policy_loss.loss_mode=cispo", "rollout.calculate_log_probs=True"],
    "gspo-rollout-is-token-icepop": ["actor.policy_loss.loss_mode=gspo", "actor.clip_ratio_low=0.0003",
                                     "actor.clip_ratio_high=0.0004", "rollout.calculate_log_probs=True"],
    "vanilla-rollout-rs-token-k1": ["rollout.calculate_log_probs=True"],
    "gspo-seq-mean-rollout-is-sequence-rs-seq-mean-k3": ["actor.policy_loss.loss_mode=gspo",
                                                         "actor.clip_ratio_low=0.0003", "actor.clip_ratio_high=0.0004",
                                                         "rollout.calculate_log_probs=True",
                                                         "actor.loss_agg_mode=seq-mean-token-mean"],
    "cispo-rollout-is-token-rs-token-k2-seq-max-k3": ["actor.policy_loss.loss_mode=cispo",
                                                      "rollout.calculate_log_probs=True"],
}
# verl's rollout correction, computed by verl's trainer from the old and the sampler's log-probs:
# importance weights (rollout_is) and rejection out of the response mask (rollout_rs)
CORRECTION = {"vanilla-rollout-is-token-tis": ["rollout_is=token", "rollout_is_threshold=1.5"],
              "cispo-rollout-is-sequence-icepop": ["rollout_is=sequence", "rollout_is_threshold='0.2_5.0'"],
              "gspo-rollout-is-token-icepop": ["rollout_is=token", "rollout_is_threshold='0.7_1.4'"],
              "vanilla-rollout-rs-token-k1": ["rollout_is=null", "rollout_rs=token_k1",
                                              "rollout_rs_threshold='0.8_1.25'"],
              "gspo-seq-mean-rollout-is-sequence-rs-seq-mean-k3": ["rollout_is=sequence", "rollout_rs=seq_mean_k3",
                                                                   "rollout_rs_threshold=0.05"],
              "cispo-rollout-is-token-rs-token-k2-seq-max-k3": ["rollout_is=token", "rollout_is_threshold=1.5",
                                                                "rollout_rs='token_k2,seq_max_k3'",
                                                                "rollout_rs_threshold='0.08,0.4'"]}
PROMPTS = [[5, 9, 13, 17, 21], [7, 8]]
RESPONSES = [[30, 31, 32, 33], [40, 41, 42, 43, 44, 45, 46], [50, 51], [60, 61, 62, 63, 64], [70, 71, 72]]
PROMPT_OF = [0, 0, 0, 1, 1]


def jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def plain_outputs(model, temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sequence next-token log-probs and entropies of every position (verl's engine output)."""
    log_probs, entropies = [], []
    for response, prompt in zip(RESPONSES, PROMPT_OF, strict=True):
        ids = torch.tensor([PROMPTS[prompt] + response])
        logits = model(ids).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        next_ids = torch.cat([ids[0, 1:], ids[0, :1]])  # the last position's value is never read
        log_probs.append(logp.gather(-1, next_ids[:, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
    return log_probs, entropies


def rows(policy_logp: list[torch.Tensor]) -> TensorDict:
    """verl's rows for the batch: old, reference and sampler log-probs perturbed away from the
    policy's so that clipping, the dual clip, the KL and the rollout weights all act; GRPO-like
    advantages of both signs."""
    generator = torch.Generator().manual_seed(0)
    fields: dict[str, list[torch.Tensor]] = {name: [] for name in ("prompts", "responses", "response_mask",
                                                                   "old_log_probs", "ref_log_prob", "rollout_log_probs",
                                                                   "advantages")}
    for index, (response, prompt) in enumerate(zip(RESPONSES, PROMPT_OF, strict=True)):
        length = len(response)
        current = policy_logp[index][len(PROMPTS[prompt]) - 1:-1].detach()
        mask = torch.ones(length, dtype=torch.int64)
        mask[-1] = 0 if index == 1 else 1  # one masked token
        fields["prompts"].append(torch.tensor(PROMPTS[prompt]))
        fields["responses"].append(torch.tensor(response))
        fields["response_mask"].append(mask)
        fields["old_log_probs"].append(current + 0.6 * torch.randn(length, generator=generator))
        fields["ref_log_prob"].append(current + 0.4 * torch.randn(length, generator=generator))
        fields["rollout_log_probs"].append(fields["old_log_probs"][-1] + 0.3 * torch.randn(length, generator=generator))
        fields["advantages"].append(torch.full((length,), (-1.0) ** index * (0.5 + index / 4)))
    return TensorDict({name: jagged(values) for name, values in fields.items()}, batch_size=[len(RESPONSES)])


def corrected_by_verls_trainer(config, data: TensorDict) -> TensorDict:
    """The rows after verl's trainer applied its rollout correction (``_compute_advantage``):
    rejected tokens out of ``response_mask``, the importance weights beside it."""
    correction = config.algorithm.rollout_correction
    if correction.rollout_is is None and correction.rollout_rs is None:
        return data
    nested_mask = data["response_mask"]
    padded = {name: data[name].to_padded_tensor(0) for name in ("old_log_probs", "rollout_log_probs", "response_mask")}
    corrected, _ = compute_rollout_correction_and_add_to_batch(
        DataProto(batch=TensorDict(padded, batch_size=len(data))), correction)
    data["response_mask"] = response_to_nested(corrected.batch["response_mask"], nested_mask)
    if "rollout_is_weights" in corrected.batch.keys():
        data["rollout_is_weights"] = response_to_nested(corrected.batch["rollout_is_weights"], nested_mask)
    return data


def verl_loss_and_grads(policy, config, temperature: float) -> tuple[float, dict[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    log_probs, entropies = plain_outputs(model, temperature)
    data = corrected_by_verls_trainer(config, rows(log_probs))
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["response_mask"].values().sum()),
                         global_batch_size=len(RESPONSES))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    outputs = {"log_probs": jagged(log_probs)}
    if actor.entropy_coeff != 0:
        outputs["entropy"] = jagged(entropies)
    loss, _ = ppo_loss(actor, outputs, data)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_equal_verl_ppo_loss(policy, case):
    config = verl_config(f"actor_rollout_ref.model.path={policy}",
                         *(f"actor_rollout_ref.{override}" for override in CASES[case]),
                         *(f"algorithm.rollout_correction.{override}" for override in CORRECTION.get(case, [])))
    temperature = float(config.actor_rollout_ref.rollout.temperature)
    expected, expected_grads = verl_loss_and_grads(policy, config, temperature)

    settings = ArcticSettings(config={"trainer": {"backend": "torch"}, "reference": None})
    with ArcticClient.in_process(arctic_config(config, settings, on_gpu=False)) as arctic:
        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
        data = corrected_by_verls_trainer(config, rows(plain_outputs(model, temperature)[0]))
        batch = to_rollout_batch(data)
        assert batch.num_prompts == len(PROMPTS)  # verl's repeated prompt ids are packed once
        actor = config.actor_rollout_ref.actor
        terms = loss_terms(actor, sampler_correction(config))
        assert ((terms[0]["sampler_correction"] is not None)
                == (config.algorithm.rollout_correction.rollout_is is not None))
        result = arctic.fwd_bwd(batch, terms, temperature=temperature,
                                max_response_len=actor.loss_scale_factor)
        server = arctic.transport.server
        grads = server.trainer.full_gradients()

    assert result.metrics["loss"] == pytest.approx(expected, abs=1e-5), case
    if "rollout-rs" in case:  # verl's rejection leaves some of the batch's tokens, not all
        assert 0 < batch.loss_mask.sum() < rows(plain_outputs(model, temperature)[0])["response_mask"].values().sum()
    # The batch exercises the clips (and the dual clip where the case sets a low clip_ratio_c).
    clipped = [value for key, value in result.metrics.items() if key.endswith("/clipfrac")
               or ("dual-clip" in case and key.endswith("/dual_clipfrac"))]
    assert all(value > 0 for value in clipped), (case, result.metrics)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert (grad - expected_grads[name]).norm() <= 1e-4 * expected_grads[name].norm() + 1e-9, (case, name)
