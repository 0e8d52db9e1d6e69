"""SkyRL's settings in Arctic's terms: the backend config, the loss terms, the sampling params.

SkyRL's trainer scales each mini-batch's advantages by its ``loss_reduction`` (token_mean,
sequence_mean, seq_mean_token_sum_norm, prompt_mean, token_mean_legacy) before its workers see
them, and its workers then *sum* the per-token policy loss; the KL loss is a mean over sequences of
per-sequence token means, and the entropy bonus a token mean per worker micro-batch weighted by the
micro-batch's share of rows. The terms below reproduce exactly that; every setting that would make
them differ is refused by :func:`refusals` with the key that names it. Settings of SkyRL's own
engines (FSDP/Megatron sharding, vLLM memory, placement) have no meaning here: Arctic runs the model.
"""

from __future__ import annotations

import os
from typing import Any

from skyrl.train.config import SkyRLTrainConfig

from arctic_core.adapters import refusals as reasons
from arctic_core.adapters.mapping import BackendInputs, backend_config, placement
from arctic_core.adapters.metrics import POLICY
from arctic_core.adapters.settings import BackendSettings
from arctic_core.adapters.translation import VLLM_SAMPLING_KEYS, vllm_sampling_params
from arctic_core.config import ArcticConfig, SamplingParams
from arctic_core.errors import ConfigError

# SkyRL's policy_loss_type -> Arctic term name (the options come from SkyRL's algorithm config).
POLICY_LOSSES = ("regular", "dual_clip", "gspo", "sapo", "cispo")
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
SKYRL_LOG_RATIO_BOUNDS = (-20.0, 20.0)  # SkyRL clamps log ratios before exp (safe_exp_delta, sapo)
SKYRL_GSPO_LOG_RATIO_BOUNDS = (None, 10.0)
K3_CLAMP = 10.0  # SkyRL's compute_approx_kl clamps k3 to [-10, 10]
# Keys of SkyRL's vLLM sampling dict that only shape text decoding or are always on here.
SAMPLING_TEXT_KEYS = {"skip_special_tokens", "include_stop_str_in_output", "min_tokens", "stop", "logprobs"}
SAMPLING_KEYS = VLLM_SAMPLING_KEYS | SAMPLING_TEXT_KEYS


# --------------------------------------------------------------------------- refusals
def refusals(cfg: SkyRLTrainConfig, settings: BackendSettings) -> list[str]:
    """Every setting arctic-skyrl cannot honour exactly, each as ``key=value: why``."""
    trainer, algorithm, generator = cfg.trainer, cfg.trainer.algorithm, cfg.generator
    found: list[str] = []

    def refuse(key: str, value: Any, why: str) -> None:
        found.append(f"{key}={value!r}: {why}")

    if trainer.critic.model.path:
        refuse("trainer.critic.model.path", trainer.critic.model.path, f"{reasons.NO_CRITIC} (grpo, rloo, "
               "reinforce++, maxrl)")
    if trainer.policy.model_config_kwargs:
        refuse("trainer.policy.model_config_kwargs", dict(trainer.policy.model_config_kwargs),
               reasons.model_config_changes("trainer.policy.model.path"))
    if algorithm.policy_loss_type not in POLICY_LOSSES:
        refuse("trainer.algorithm.policy_loss_type", algorithm.policy_loss_type,
               f"supported: {', '.join(POLICY_LOSSES)}")
    if algorithm.policy_loss_type == "cispo" and algorithm.cispo.cispo_anchor != "old":
        refuse("trainer.algorithm.cispo.cispo_anchor", algorithm.cispo.cispo_anchor,
               "only the 'old' anchor is supported")
    if algorithm.use_kl_loss and algorithm.kl_estimator_type not in KL_ESTIMATORS:
        refuse("trainer.algorithm.kl_estimator_type", algorithm.kl_estimator_type,
               f"supported: {', '.join(KL_ESTIMATORS)}")
    _refuse_off_policy_correction(cfg, refuse)
    if algorithm.use_entropy_loss and (trainer.max_tokens_per_microbatch > 0 or not entropy_is_exact(cfg)):
        refuse("trainer.micro_train_batch_size_per_gpu", trainer.micro_train_batch_size_per_gpu, "SkyRL's entropy "
               "bonus is a token mean per worker micro-batch; Arctic reproduces it for micro-batches of 1 row or "
               "of the whole mini-batch (policy_mini_batch_size x n_samples_per_prompt rows), with "
               "trainer.max_tokens_per_microbatch=-1")
    if algorithm.enable_sample_support_replay:
        refuse("trainer.algorithm.enable_sample_support_replay", True, "sample-support replay is not supported")
    if trainer.policy.model.lora.rank > 0:
        refuse("trainer.policy.model.lora.rank", trainer.policy.model.lora.rank, reasons.FULL_WEIGHTS)
    if _real(trainer.ref.model.path) != _real(trainer.policy.model.path):
        refuse("trainer.ref.model.path", trainer.ref.model.path, "Arctic's reference model is the initial policy "
               "(trainer.policy.model.path)")
    if trainer.update_ref_every_epoch:
        refuse("trainer.update_ref_every_epoch", True, "Arctic's reference model stays the initial policy")
    if trainer.policy.optimizer_config.scheduler not in SCHEDULERS:
        refuse("trainer.policy.optimizer_config.scheduler", trainer.policy.optimizer_config.scheduler,
               f"supported: {', '.join(SCHEDULERS)}")
    if trainer.policy.torch_profiler_config.enable:
        refuse("trainer.policy.torch_profiler_config.enable", True, reasons.own_workers("SkyRL's profiler"))
    if trainer.fully_async.enabled:
        refuse("trainer.fully_async.enabled", True, "the synchronous trainer only")
    if generator.vision_language_generator:
        refuse("generator.vision_language_generator", True, reasons.TEXT_ONLY)
    if generator.inference_engine.enable_return_routed_experts:
        refuse("generator.inference_engine.enable_return_routed_experts", True, "router replay is not supported")
    for phase, params in (("sampling_params", generator.sampling_params),
                          ("eval_sampling_params", generator.eval_sampling_params)):
        if params is not None and params.stop:
            refuse(f"generator.{phase}.stop", list(params.stop), f"{reasons.STOP_STRINGS}: set "
                   f"generator.{phase}.additional_kwargs.stop_token_ids")
        unknown = sorted(set(params.additional_kwargs or {}) - SAMPLING_KEYS) if params is not None else []
        if unknown:
            refuse(f"generator.{phase}.additional_kwargs", unknown, f"supported: {', '.join(sorted(SAMPLING_KEYS))}")
    return found


def _refuse_off_policy_correction(cfg: SkyRLTrainConfig, refuse) -> None:
    """Every SkyRL off-policy correction maps to Arctic's sampler correction; a zero cap does not."""
    if cfg.trainer.algorithm.use_tis and cfg.trainer.algorithm.tis_imp_ratio_cap <= 0:
        refuse("trainer.algorithm.tis_imp_ratio_cap", cfg.trainer.algorithm.tis_imp_ratio_cap,
               "use_tis needs a positive cap (or off_policy_correction.tis_ratio_type with its clip_high)")


def sampler_correction(cfg: SkyRLTrainConfig) -> dict[str, Any] | None:
    """SkyRL's off-policy correction as Arctic's sampler correction: its TIS weights ``exp(old -
    rollout)`` log-probs, per token or per sequence, truncated from above (the deprecated
    ``use_tis`` is the token kind at ``tis_imp_ratio_cap``, as SkyRL reads it), and its masks as
    rejections (a rejected token weighs 0 and still counts in SkyRL's loss reduction, which its
    trainer folded into the advantages). (SkyRL clamps the log ratio to [-20, 20] first: the same
    weights unless the trainer and sampler differ by more than 20 nats.)"""
    algorithm = cfg.trainer.algorithm
    correction = algorithm.off_policy_correction
    weights: dict[str, Any] = {"mode": "none"}
    if algorithm.use_tis:
        weights = {"mode": "token-truncate", "high": algorithm.tis_imp_ratio_cap}
    elif correction.tis_ratio_type == "token":
        weights = {"mode": "token-truncate", "high": correction.token_tis_ratio_clip_high}
    elif correction.tis_ratio_type == "sequence":
        weights = {"mode": "sequence-truncate", "high": correction.sequence_tis_ratio_clip_high}
    rejections = _rejections(correction)
    return None if weights["mode"] == "none" and not rejections else weights | rejections


def _rejections(correction: Any) -> dict[str, Any]:
    """SkyRL's outlier, token and sequence masks, each where SkyRL applies it."""
    rules: dict[str, Any] = {}
    low, high = correction.outlier_token_is_threshold_low, correction.outlier_token_is_threshold_high
    if low is not None or high is not None:
        rules["reject_sequences_with_token"] = {"low": low, "high": high}
    low, high = correction.token_mask_is_threshold_low, correction.token_mask_is_threshold_high
    if low is not None and high is not None:  # SkyRL applies its token mask with both bounds only
        rules["reject_tokens"] = {"low": low, "high": high}
    if correction.sequence_mask_metric == "geometric":
        rules["reject_sequences"] = {"low": correction.geo_mask_low, "high": correction.geo_mask_high,
                                     "statistic": "geometric"}
    elif correction.sequence_mask_metric == "product":
        rules["reject_sequences"] = {"low": correction.product_mask_low, "high": correction.product_mask_high}
    return rules


def _real(path: str | None) -> str:
    return os.path.realpath(os.path.expanduser(str(path)))


# --------------------------------------------------------------------------- loss
def policy_term(cfg: SkyRLTrainConfig) -> dict[str, Any]:
    """The Arctic term equal to SkyRL's ``policy_loss_type``, summed over tokens: SkyRL's trainer
    has already scaled the advantages by its loss reduction."""
    algorithm = cfg.trainer.algorithm
    mode, low, high = algorithm.policy_loss_type, algorithm.eps_clip_low, algorithm.eps_clip_high
    if mode in ("regular", "dual_clip"):
        term = {"name": "ppo", "clip_low": low, "clip_high": high, "aggregation": "token-sum",
                "log_ratio_bounds": SKYRL_LOG_RATIO_BOUNDS}
        return term | ({"dual_clip": algorithm.clip_ratio_c} if mode == "dual_clip" else {})
    if mode == "gspo":
        return {"name": "gspo", "clip_low": low, "clip_high": high, "aggregation": "token-sum",
                "sequence_gradient": "token", "log_ratio_bounds": SKYRL_GSPO_LOG_RATIO_BOUNDS}
    if mode == "sapo":
        return {"name": "sapo", "temperature_pos": algorithm.sapo.tau_pos, "temperature_neg": algorithm.sapo.tau_neg,
                "aggregation": "token-sum", "log_ratio_bounds": SKYRL_LOG_RATIO_BOUNDS}
    if mode == "cispo":
        cispo = algorithm.cispo
        return {"name": "cispo", "ratio_cap": 1.0 + cispo.cispo_eps_clip_high,
                "ratio_floor": 1.0 - cispo.cispo_eps_clip_low, "aggregation": "token-sum",
                "log_ratio_bounds": SKYRL_LOG_RATIO_BOUNDS}
    raise ConfigError(f"trainer.algorithm.policy_loss_type={mode!r}: supported: {', '.join(POLICY_LOSSES)}")


def entropy_aggregation(cfg: SkyRLTrainConfig) -> str:
    """SkyRL's entropy bonus: a token mean per worker micro-batch (``micro_train_batch_size_per_gpu``
    rows), each weighted by its share of the mini-batch's rows: one row per micro-batch makes that
    a mean over sequences, one micro-batch for the whole mini-batch a mean over tokens."""
    return "seq-mean-token-mean" if cfg.trainer.micro_train_batch_size_per_gpu == 1 else "token-mean"


def entropy_is_exact(cfg: SkyRLTrainConfig) -> bool:
    """Whether :func:`entropy_aggregation` is SkyRL's: micro-batches of one row, or one micro-batch."""
    micro = cfg.trainer.micro_train_batch_size_per_gpu
    mini_batch_rows = cfg.trainer.policy_mini_batch_size * cfg.generator.n_samples_per_prompt
    return micro == 1 or (micro >= mini_batch_rows and not cfg.generator.step_wise_trajectories)


def loss_terms(cfg: SkyRLTrainConfig) -> list[dict[str, Any]]:
    """SkyRL's policy worker loss (``PolicyWorkerBase._forward_backward_micro``) as Arctic terms."""
    algorithm = cfg.trainer.algorithm
    terms = [{**policy_term(cfg), "sampler_correction": sampler_correction(cfg)}]
    if algorithm.use_kl_loss:
        estimator = algorithm.kl_estimator_type
        terms.append({"name": "kl", "weight": algorithm.kl_loss_coef, "estimator": estimator,
                      "clamp": K3_CLAMP if estimator == "k3" else None, "aggregation": "seq-mean-token-mean"})
    # SkyRL reports every micro-batch's entropy: without the bonus the term has weight 0, a metric only.
    terms.append({"name": "entropy", "weight": algorithm.entropy_loss_coef if algorithm.use_entropy_loss else 0.0,
                  "aggregation": entropy_aggregation(cfg)})
    return terms


# --------------------------------------------------------------------------- backend
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")


def backend_inputs(cfg: SkyRLTrainConfig, on_gpu: bool) -> BackendInputs:
    """SkyRL's model and optimizer; bf16 on a GPU, fp32 on the CPU."""
    policy, algorithm = cfg.trainer.policy, cfg.trainer.algorithm
    optim = policy.optimizer_config
    return BackendInputs(
        model_path=str(policy.model.path), **placement(on_gpu),
        optimizer={"lr": optim.lr, "betas": list(optim.adam_betas), "weight_decay": optim.weight_decay,
                   "max_grad_norm": optim.max_grad_norm if optim.max_grad_norm > 0 else None},  # <= 0: off
        gradient_checkpointing=bool(cfg.trainer.gradient_checkpointing),
        reference=algorithm.use_kl_loss or algorithm.use_kl_in_reward, seed=int(cfg.trainer.seed))


class SkyRLMapping:
    """SkyRL 0.4's settings in Arctic's terms (see :class:`arctic_core.adapters.mapping.FrameworkMapping`)."""

    adapter, framework, supported = "arctic-skyrl", "skyrl", ("0.4.0", "0.5")
    owner = "SkyRL's own config (trainer.policy...)"
    # SkyRL's worker metrics that Arctic computes (the entropy term aggregates as SkyRL's
    # micro-batch means do).
    metric_names = {"final_loss": "loss", "policy_loss": f"{POLICY}/loss",
                    "loss_metrics/clip_ratio": f"{POLICY}/clipfrac",
                    "policy_kl": "kl/loss", "policy_entropy": "-entropy/loss"}
    refusals = staticmethod(refusals)
    loss_terms = staticmethod(loss_terms)
    backend_inputs = staticmethod(backend_inputs)


MAPPING = SkyRLMapping()


def arctic_config(cfg: SkyRLTrainConfig, settings: BackendSettings, on_gpu: bool) -> ArcticConfig:
    """The backend the adapter starts: SkyRL's model and optimizer, Arctic's engines
    (``arctic.config`` overrides engine choices)."""
    return backend_config(MAPPING, cfg, settings, on_gpu)


def to_sampling_params(request: dict[str, Any]) -> tuple[SamplingParams, bool]:
    """SkyRL's sampling dict (vLLM's names, ``get_sampling_params_for_backend``) as Arctic's params
    (n=1), and whether the caller asked for the sampler's log-probs."""
    unknown = sorted(key for key, value in request.items() if key not in SAMPLING_KEYS and value is not None)
    if unknown:
        raise ValueError(f"arctic-skyrl: sampling params {unknown} have no Arctic meaning "
                         f"(supported: {', '.join(sorted(SAMPLING_KEYS))})")
    if request.get("stop"):
        raise ValueError(f"arctic-skyrl: stop strings {request['stop']} are not supported; use stop_token_ids")
    params = vllm_sampling_params(request, request["max_tokens"])
    return params, request.get("logprobs") is not None
