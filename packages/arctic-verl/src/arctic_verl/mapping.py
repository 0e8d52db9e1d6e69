"""verl's settings in Arctic's terms: the backend config, the loss terms, the sampling params.

Each verl setting that shapes the loss, the sampling or the optimizer is honoured exactly (the
loss terms reproduce verl's ``ppo_loss``: policy loss, entropy bonus, KL loss, each aggregated by
``loss_agg_mode`` over the mini-batch) or refused by :func:`refusals` with the key that names it.
Settings of verl's own engines (FSDP/Megatron sharding, micro-batch sizes, vLLM memory) have no
meaning here: Arctic runs the model.
"""

from __future__ import annotations

import warnings
from typing import Any

from omegaconf import DictConfig, OmegaConf

from arctic_core.adapters import refusals as reasons
from arctic_core.adapters.mapping import BackendInputs, backend_config, placement
from arctic_core.adapters.metrics import POLICY
from arctic_core.adapters.preflight import describe
from arctic_core.adapters.translation import VLLM_SAMPLING_KEYS, vllm_sampling_params
from arctic_core.config import ArcticConfig, SamplingParams
from arctic_core.errors import ConfigError
from arctic_verl.settings import ArcticSettings

# verl's policy_loss.loss_mode -> how to build the matching Arctic term from the actor config.
POLICY_LOSSES = ("vanilla", "gspo", "sapo", "cispo", "gpg")
# verl's kl_loss_type (without the '+' suffix) -> (Arctic estimator, clamp verl applies).
KL_TYPES: dict[str, tuple[str, float | None]] = {
    "kl": ("k1", None), "k1": ("k1", None), "abs": ("abs", None), "mse": ("k2", None), "k2": ("k2", None),
    "low_var_kl": ("k3", 10.0), "k3": ("k3", 10.0),
}
VERL_LOG_RATIO_BOUNDS = (-20.0, 20.0)  # verl clamps log ratios before exp (vanilla, sapo, cispo)
VERL_GSPO_LOG_RATIO_BOUNDS = (None, 10.0)
SAMPLING_KEYS = VLLM_SAMPLING_KEYS | {"logprobs", "max_new_tokens"}


def get(config: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(config, key, default=default)


def actor_optim(config: DictConfig) -> Any:
    """The actor's optimizer settings as verl's own config class reads them: its deprecated
    aliases (``warmup_style``, ``grad_clip``) applied, as verl's engines see them."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPOptimizerConfig

    with warnings.catch_warnings():  # verl warns that the aliases are deprecated: its own users' news
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return omega_conf_to_dataclass(config.actor_rollout_ref.actor.optim, FSDPOptimizerConfig)
        except (AssertionError, ValueError, TypeError) as exc:  # verl's own checks, some of them bare asserts
            raise ConfigError(f"actor_rollout_ref.actor.optim: {describe(exc, "verl's")}") from None


# --------------------------------------------------------------------------- refusals
def refusals(config: DictConfig, settings: ArcticSettings) -> list[str]:
    """Every setting arctic-verl cannot honour exactly, each as ``key=value: why``."""
    actor, found = "actor_rollout_ref.actor", []

    def refuse(key: str, why: str) -> None:
        found.append(f"{key}={get(config, key)!r}: {why}")

    from verl.trainer.ppo.utils import need_critic  # verl's own rule for needing a critic

    with warnings.catch_warnings():  # verl warns that it disables the critic: not news here
        warnings.simplefilter("ignore")
        critic = need_critic(config)
    if not get(config, "trainer.use_v1", True):
        refuse("trainer.use_v1", "trainer.v1.trainer_mode=arctic runs in verl's v1 trainer; the legacy trainer "
               "ignores trainer modes and would train on verl's own engines")
    if critic:
        found.append(f"algorithm.adv_estimator={get(config, 'algorithm.adv_estimator')!r} / critic.enable: "
                     f"{reasons.NO_CRITIC} (grpo, rloo, reinforce_plus_plus, remax, ...)")
    if get(config, "reward.reward_model.enable"):
        refuse("reward.reward_model.enable", "model-based rewards run on verl's GPU reward workers; use a "
               "reward function (reward.custom_reward_function)")
    if get(config, "distillation.enabled"):
        refuse("distillation.enabled", "on-policy distillation is not supported")
    if ((get(config, "actor_rollout_ref.model.lora_rank") or 0) > 0
            or (get(config, "actor_rollout_ref.model.lora.rank") or 0) > 0):
        refuse("actor_rollout_ref.model.lora_rank", reasons.FULL_WEIGHTS)
    if get(config, "actor_rollout_ref.model.lora_adapter_path"):
        refuse("actor_rollout_ref.model.lora_adapter_path", reasons.FULL_WEIGHTS)
    for key in ("actor_rollout_ref.model.override_config", "actor_rollout_ref.model.hf_config_path"):
        if get(config, key):
            refuse(key, reasons.model_config_changes("actor_rollout_ref.model.path"))
    loaded = set(get(config, f"{actor}.checkpoint.load_contents") or ())
    if get(config, "trainer.resume_mode", "auto") != "disable" and not {"model", "optimizer", "extra"} <= loaded:
        refuse(f"{actor}.checkpoint.load_contents", "Arctic resumes the weights, the optimizer and the schedule "
               "together: list model, optimizer and extra (or set trainer.resume_mode=disable)")
    mode = get(config, f"{actor}.policy_loss.loss_mode", "vanilla")
    if mode not in POLICY_LOSSES:
        refuse(f"{actor}.policy_loss.loss_mode", f"supported: {', '.join(POLICY_LOSSES)}")
    if (get(config, f"{actor}.loss_agg_mode") == "seq-mean-token-sum-norm"
            and get(config, f"{actor}.loss_scale_factor") is None):
        refuse(f"{actor}.loss_agg_mode", "without actor.loss_scale_factor verl divides each micro-batch by its own "
               "padded width, which depends on how verl would cut micro-batches; set "
               f"{actor}.loss_scale_factor=<response_length> (verl's recommended constant)")
    kl_type = str(get(config, f"{actor}.kl_loss_type", "low_var_kl"))
    if get(config, f"{actor}.use_kl_loss") and kl_type.removesuffix("+") not in KL_TYPES:
        refuse(f"{actor}.kl_loss_type", f"supported: {', '.join(KL_TYPES)} (each optionally with '+')")
    _refuse_rollout_correction(config, refuse)
    optim = f"{actor}.optim"
    if (str(get(config, f"{optim}.optimizer", "AdamW")) != "AdamW"
            or str(get(config, f"{optim}.optimizer_impl", "torch.optim")) != "torch.optim"):
        refuse(f"{optim}.optimizer", reasons.ADAMW_ONLY)
    if get(config, f"{optim}.override_optimizer_config"):
        refuse(f"{optim}.override_optimizer_config", "not supported; set lr, betas, weight_decay, clip_grad")
    if get(config, "global_profiler.steps"):
        refuse("global_profiler.steps", reasons.own_workers("verl's profiler"))
    return found


def _refuse_rollout_correction(config: DictConfig, refuse) -> None:
    """verl's rollout correction in decoupled mode: its trainer computes the rejection (``rollout_rs``)
    into the response mask and Arctic trains on that mask; its importance weights (token or sequence;
    TIS or IcePop) map to Arctic's sampler correction. Batch-normalised weights, bypass mode, and
    sequence weights beside a token-level rejection (verl weighs a sequence by all its tokens,
    Arctic by the tokens kept) do not map."""
    section = "algorithm.rollout_correction"
    level, rejection = get(config, f"{section}.rollout_is"), get(config, f"{section}.rollout_rs")
    if level is None and rejection is None:
        return
    if level is not None and get(config, f"{section}.rollout_is_batch_normalize"):
        refuse(f"{section}.rollout_is_batch_normalize", "batch-normalised weights are not supported")
    if get(config, f"{section}.bypass_mode"):
        refuse(f"{section}.bypass_mode", "rollout correction in bypass mode is not supported (decoupled mode is)")
    token_rules = [rule for rule in str(rejection or "").split(",") if rule.strip().startswith("token_")]
    if level == "sequence" and token_rules:
        refuse(f"{section}.rollout_rs", f"token-level rejection ({', '.join(token_rules)}) with rollout_is=sequence "
               "is not supported (token or sequence-level rejection with rollout_is=token is)")
    try:
        sampler_correction(config)
    except ValueError:
        refuse(f"{section}.rollout_is_threshold", "a number (truncation from above) or '<lower>_<upper>' such as "
               "'0.2_5.0' (a band)")
    if not get(config, "actor_rollout_ref.rollout.calculate_log_probs"):
        refuse(f"{section}.rollout_{'is' if level is not None else 'rs'}", "needs actor_rollout_ref.rollout."
               "calculate_log_probs=True (the sampler's log-probs the correction compares with; verl would skip it "
               "silently)")


# --------------------------------------------------------------------------- loss
def policy_term(actor: DictConfig) -> dict[str, Any]:
    """The Arctic term equal to verl's policy loss ``policy_loss.loss_mode``."""
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    mode, aggregation = actor.policy_loss.get("loss_mode", "vanilla"), actor.loss_agg_mode
    if mode == "vanilla":  # verl always applies its dual clip (clip_ratio_c, default 3)
        return {"name": "ppo", "clip_low": low, "clip_high": high, "dual_clip": actor.get("clip_ratio_c", 3.0),
                "aggregation": aggregation, "log_ratio_bounds": VERL_LOG_RATIO_BOUNDS}
    if mode == "gspo":
        return {"name": "gspo", "clip_low": low, "clip_high": high, "aggregation": aggregation,
                "sequence_gradient": "token", "log_ratio_bounds": VERL_GSPO_LOG_RATIO_BOUNDS}
    if mode == "sapo":  # verl's SAPO always averages per sequence first
        return {"name": "sapo", "temperature_pos": actor.tau_pos, "temperature_neg": actor.tau_neg,
                "aggregation": "seq-mean-token-mean", "log_ratio_bounds": VERL_LOG_RATIO_BOUNDS}
    if mode == "cispo":
        return {"name": "cispo", "ratio_cap": 1.0 + high, "ratio_floor": 1.0 - low, "aggregation": aggregation,
                "log_ratio_bounds": VERL_LOG_RATIO_BOUNDS}
    if mode == "gpg":
        return {"name": "pg", "aggregation": aggregation}
    raise ConfigError(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r}: supported: {', '.join(POLICY_LOSSES)}")


def kl_term(actor: DictConfig) -> dict[str, Any]:
    """verl's KL loss: ``kl_loss_coef * agg(kl_penalty(log_prob, ref_log_prob, kl_loss_type))``."""
    kl_type = str(actor.kl_loss_type)
    estimator, clamp = KL_TYPES[kl_type.removesuffix("+")]
    straight_through = kl_type.endswith("+") and estimator != "k2"  # verl: k2's gradient, the estimator's value
    return {"name": "kl", "weight": actor.kl_loss_coef, "estimator": estimator, "clamp": clamp,
            "gradient": "k2" if straight_through else "estimator", "aggregation": actor.loss_agg_mode}


def sampler_correction(config: DictConfig) -> dict[str, Any] | None:
    """verl's ``rollout_is`` weights, ``exp(old - rollout)`` log-probs per token or per sequence:
    a single threshold truncates them from above (TIS), ``"<lower>_<upper>"`` (``"0.2_5.0"``) zeroes
    them outside the band (IcePop). (verl clamps the log ratio to [-20, 20] first: the same weights
    unless the trainer and sampler differ by more than 20 nats.)"""
    level = get(config, "algorithm.rollout_correction.rollout_is")
    if level is None:
        return None
    threshold = get(config, "algorithm.rollout_correction.rollout_is_threshold", 2.0)
    low, _, high = str(threshold).strip().rpartition("_")
    return {"mode": f"{level}-{'mask' if low else 'truncate'}", "low": float(low) if low else None,
            "high": float(high)}


def loss_terms(actor: DictConfig, correction: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """verl's actor loss (``verl.workers.utils.losses.ppo_loss``) as Arctic loss terms; verl's
    rollout importance weights multiply the policy term's per-token losses (``correction``)."""
    terms = [{**policy_term(actor), "sampler_correction": correction}]
    if actor.entropy_coeff != 0:
        terms.append({"name": "entropy", "weight": actor.entropy_coeff, "aggregation": actor.loss_agg_mode})
    if actor.use_kl_loss:
        terms.append(kl_term(actor))
    return terms


# --------------------------------------------------------------------------- backend
def backend_inputs(config: DictConfig, on_gpu: bool) -> BackendInputs:
    """verl's model and optimizer; bf16 on a GPU, fp32 on the CPU."""
    from verl.trainer.ppo.utils import need_reference_policy

    optim = actor_optim(config)
    return BackendInputs(
        model_path=str(get(config, "actor_rollout_ref.model.path")), **placement(on_gpu),
        optimizer={"lr": optim.lr, "betas": list(optim.betas), "weight_decay": optim.weight_decay,
                   "max_grad_norm": optim.clip_grad},
        gradient_checkpointing=bool(get(config, "actor_rollout_ref.model.enable_gradient_checkpointing", False)),
        reference=need_reference_policy(config), seed=int(get(config, "actor_rollout_ref.rollout.seed", 0) or 0))


class VerlMapping:
    """verl 0.9's settings in Arctic's terms (see :class:`arctic_core.adapters.mapping.FrameworkMapping`)."""

    adapter, framework, supported = "arctic-verl", "verl", ("0.9.1", "0.10")
    owner = "verl's own config (actor_rollout_ref...)"
    # verl's actor metrics that Arctic computes (the step's mini-batches reduced as verl reduces them).
    metric_names = {"actor/pg_loss": f"train/{POLICY}/loss", "actor/pg_clipfrac": f"train/{POLICY}/clipfrac",
                    "actor/pg_clipfrac_lower": f"train/{POLICY}/dual_clipfrac", "actor/kl_loss": "train/kl/loss",
                    "actor/grad_norm": "step/grad_norm", "actor/entropy_loss": "-train/entropy/loss"}
    refusals = staticmethod(refusals)
    backend_inputs = staticmethod(backend_inputs)

    @staticmethod
    def loss_terms(config: DictConfig) -> list[dict[str, Any]]:
        return loss_terms(config.actor_rollout_ref.actor, sampler_correction(config))


MAPPING = VerlMapping()


def arctic_config(config: DictConfig, settings: ArcticSettings, on_gpu: bool) -> ArcticConfig:
    """The backend the adapter starts: verl's model and optimizer, Arctic's engines
    (``arctic.config`` overrides engine choices)."""
    return backend_config(MAPPING, config, settings, on_gpu)


def with_server_defaults(request: dict[str, Any], rollout: DictConfig, prompt_len: int) -> dict[str, Any]:
    """What verl's vLLM server adds to an agent loop's request: the rollout's repetition penalty and
    ``ignore_eos``, and, when the request names no length, ``response_length`` capped by what a
    multi-turn prompt has left of ``prompt_length + response_length``."""
    request = dict(request)
    request.setdefault("repetition_penalty", rollout.get("repetition_penalty", 1.0))
    request.setdefault("ignore_eos", rollout.get("ignore_eos", False))
    if "max_tokens" not in request and "max_new_tokens" not in request:
        budget = rollout.prompt_length + rollout.response_length - prompt_len
        request["max_tokens"] = max(1, min(rollout.response_length, budget))
    return request


def to_sampling_params(request: dict[str, Any], rollout: DictConfig, prompt_len: int) -> tuple[SamplingParams, bool]:
    """One verl sampling request (``sampling_params`` of ``generate``) for a prompt of
    ``prompt_len`` tokens as Arctic's params (n=1), with what verl's server adds to it
    (:func:`with_server_defaults`), and whether the caller asked for the sampler's log-probs."""
    unknown = sorted(set(request) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"arctic-verl: sampling params {unknown} have no Arctic meaning "
                         f"(supported: {', '.join(sorted(SAMPLING_KEYS))})")
    request = with_server_defaults(request, rollout, prompt_len)
    params = vllm_sampling_params(request, request.get("max_new_tokens") or request.get("max_tokens"))
    return params, bool(request.get("logprobs"))
