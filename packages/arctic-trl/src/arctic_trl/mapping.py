"""GRPOConfig -> Arctic: TRL 1.16's loss as Arctic's loss terms, its sampling settings, and the
few settings that are refused.

TRL computes rewards and advantages; Arctic runs generation, log-probs, the loss with its backward
and the optimizer step. ``loss_terms`` reproduces ``GRPOTrainer._compute_loss`` of TRL 1.16 term
by term for every ``loss_type`` (the clipped family grpo / bnpo / dr_grpo / dapo / luspo, and
cispo, sapo, vespo), at either importance-sampling level, with two-sided clipping (``delta``),
the bias-corrected KL, entropy masking, the off-policy mask and the entropy bonus, with the same
normalisation per loss type: a micro-batch's loss and gradients are TRL's.

``use_vllm=True`` keeps Arctic's sampler generating in vLLM's place; ``VLLM_SETTINGS`` says what
becomes of each of TRL's ``vllm_*`` settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from transformers import AutoConfig, PretrainedConfig
from trl import GRPOConfig

from arctic_core.adapters import refusals as reasons
from arctic_core.adapters.mapping import BackendInputs
from arctic_core.adapters.translation import overlay
from arctic_core.config import SamplerConfig, TrainerConfig
from arctic_core.hf import max_positions

# loss_type -> how TRL reduces per-token losses within a micro-batch (our aggregation)
AGGREGATION = {"grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "bnpo": "token-mean",
               "dr_grpo": "seq-mean-token-sum-norm", "dapo": "token-mean", "cispo": "token-mean",
               "vespo": "token-mean", "luspo": "seq-mean-token-sum"}
# ... and which normalise by the tokens of the whole accumulation window rather than per micro-batch
WINDOW_NORMALISED = {"dapo", "cispo", "vespo"}
# the values TRL 1.16 has for importance_sampling_level and vllm_importance_sampling_mode
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# generation_kwargs keys with an Arctic sampling setting of the same meaning
GENERATION_KWARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty"}

# TRL 1.16's vLLM settings, read with use_vllm=True: Arctic's own sampler then generates in vLLM's
# place (in either vllm_mode). Each is (the vllm_mode TRL reads it in, None for both; what the
# adapter does with it). Read in TRL's mode only, and only where the value is not TRL's default
# (TRL's defaults size vLLM beside TRL's own trainer, not Arctic's sampler):
#   mode      colocate: Arctic's sampler in this process; server: the same, with a notice
#   sampler   an option of the same meaning of the sampler the config runs (SAMPLER_OPTIONS)
#   colocate  Arctic's colocate: the engines sleep in turn, as vLLM sleeps while TRL trains
#   server    configures the vLLM server Arctic's sampler replaces: unused, named in the notice
#   loss      the sampler correction, honoured with or without use_vllm (sampler_correction)
#   refused   no counterpart (VLLM_REFUSED says why)
VLLM_SETTINGS: dict[str, tuple[str | None, str]] = {
    "vllm_mode": (None, "mode"),
    "vllm_gpu_memory_utilization": ("colocate", "sampler"),
    "vllm_max_model_length": ("colocate", "sampler"),
    "vllm_model_impl": ("colocate", "sampler"),
    "vllm_enable_sleep_mode": ("colocate", "colocate"),
    "vllm_tensor_parallel_size": ("colocate", "refused"),
    "vllm_structured_outputs_regex": (None, "refused"),
    "vllm_server_base_url": ("server", "server"),
    "vllm_server_host": ("server", "server"),
    "vllm_server_port": ("server", "server"),
    "vllm_server_timeout": ("server", "server"),
    "vllm_group_port": ("server", "server"),
    "vllm_importance_sampling_correction": (None, "loss"),
    "vllm_importance_sampling_mode": (None, "loss"),
    "vllm_importance_sampling_clip_min": (None, "loss"),
    "vllm_importance_sampling_clip_max": (None, "loss"),
    "vllm_importance_sampling_cap": (None, "loss"),  # TRL moves it to clip_max
}
VLLM_REFUSED = {
    "vllm_tensor_parallel_size": "Arctic's samplers do not shard a model over GPUs; on several GPUs run sampler "
                                 "replicas (arctic={'sampler': {'backend': 'ray', 'options': {'replicas': N}}})",
    "vllm_structured_outputs_regex": "Arctic's samplers do not constrain decoding to a regex",
}
VLLM_MODES = ("colocate", "server")
VLLM_MODEL_IMPLS = ("vllm", "transformers", "auto")
TRL_DEFAULTS = {field.name: field.default for field in fields(GRPOConfig)}


def _vllm_memory(value: float) -> dict[str, Any]:
    return {"gpu_memory_utilization": value}


def _vllm_length(value: int) -> dict[str, Any]:
    return {"max_model_len": value}


# The "sampler" settings as options of the sampling backends that have them. The embedded engine
# runs its own decoder for the models it knows and transformers' modules for others, as vLLM does:
# model_impl='transformers' asks for transformers' modules whatever the model.
SAMPLER_OPTIONS: dict[str, dict[str, Callable[[Any], dict[str, Any]]]] = {
    "embedded": {"vllm_gpu_memory_utilization": _vllm_memory, "vllm_max_model_length": _vllm_length,
                 "vllm_model_impl": lambda impl: {"fused_decoder": impl != "transformers"}},
    "vllm": {"vllm_gpu_memory_utilization": _vllm_memory, "vllm_max_model_length": _vllm_length,
             "vllm_model_impl": lambda impl: {"engine_args": {"model_impl": impl}}},
}


def unsupported(args: GRPOConfig) -> list[str]:
    """The settings of ``args`` Arctic cannot reproduce exactly, each with what to do instead."""
    problems = []
    if args.world_size > 1:  # each process would start its own backend, or step a shared one once per process
        problems.append(f"{args.world_size} processes: run TRL as one process (python, not torchrun or accelerate "
                        "launch); the backend spreads training over GPUs itself (arctic={'trainer': {'backend': "
                        "'ray', 'options': {'workers': N}}})")
    if args.loss_type not in AGGREGATION:
        problems.append(f"loss_type={args.loss_type!r} (TRL 1.16's: {', '.join(AGGREGATION)})")
    if args.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        problems.append(f"importance_sampling_level={args.importance_sampling_level!r} (TRL's: "
                        f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)})")
    if args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode not in SAMPLER_CORRECTION_MODES:
        problems.append(f"vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r} (TRL's: "
                        f"{', '.join(SAMPLER_CORRECTION_MODES)})")
    problems += unsupported_vllm(args)
    if sampler_correction(args, True) and args.loss_type == "vespo" and \
            not args.vllm_importance_sampling_mode.startswith("token"):
        problems.append(f"loss_type='vespo' with vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r}: "
                        "VESPO takes token_truncate or token_mask (as TRL requires with vLLM)")
    unknown = sorted(set(args.generation_kwargs or {}) - set(GENERATION_KWARGS))
    if unknown:
        problems.append(f"generation_kwargs {unknown}: Arctic's samplers honour {sorted(GENERATION_KWARGS)}")
    optim = str(getattr(args.optim, "value", args.optim))
    if not optim.startswith("adamw_torch") or args.optim_args:
        problems.append(f"optim={optim!r}, optim_args={args.optim_args!r}: {reasons.ADAMW_ONLY} "
                        "(optim='adamw_torch' or 'adamw_torch_fused', no optim_args)")
    if args.load_best_model_at_end:
        problems.append("load_best_model_at_end: resume from a checkpoint instead (resume_from_checkpoint)")
    if args.sync_ref_model:
        problems.append("sync_ref_model: Arctic's reference engine keeps the initial policy")
    if args.cast_lm_head_to_fp32:
        problems.append("cast_lm_head_to_fp32: Arctic computes the LM head in the model's dtype")
    if args.model_init_kwargs:
        problems.append(f"model_init_kwargs {sorted(args.model_init_kwargs)}: the backend loads the model folder as "
                        "it is (set the dtype with arctic={'model': {'dtype': ...}})")
    return problems


def unsupported_vllm(args: GRPOConfig) -> list[str]:
    """The vLLM settings of ``args`` Arctic's samplers have no counterpart for."""
    if not args.use_vllm:
        return []
    if args.vllm_mode not in VLLM_MODES:
        return [f"vllm_mode={args.vllm_mode!r} (TRL's: {', '.join(VLLM_MODES)})"]
    problems = [f"{key}={value!r}: {VLLM_REFUSED[key]}" for key, value in vllm_settings(args, "refused").items()]
    impl = vllm_settings(args, "sampler").get("vllm_model_impl")
    if impl is not None and impl not in VLLM_MODEL_IMPLS:
        problems.append(f"vllm_model_impl={impl!r}: Arctic's samplers run their own implementation ('vllm', "
                        "'auto') or transformers' ('transformers')")
    return problems


def vllm_settings(args: GRPOConfig, handling: str) -> dict[str, Any]:
    """The vLLM settings TRL reads from ``args`` (with use_vllm, in its vllm_mode) that are not TRL's
    defaults and that the adapter handles as ``handling`` (see ``VLLM_SETTINGS``)."""
    if not args.use_vllm:
        return {}
    return {key: getattr(args, key) for key, (mode, how) in VLLM_SETTINGS.items()
            if how == handling and mode in (None, args.vllm_mode) and getattr(args, key) != TRL_DEFAULTS[key]}


def vllm_sampler_options(args: GRPOConfig, backend: str) -> tuple[dict[str, Any], list[str]]:
    """The options of sampling backend ``backend`` that TRL's vLLM settings give, and the settings
    that backend has no option for."""
    options: dict[str, Any] = {}
    unmatched = []
    for key, value in vllm_settings(args, "sampler").items():
        option = SAMPLER_OPTIONS.get(backend, {}).get(key)
        if option is None:
            unmatched.append(key)
        else:
            options = overlay(options, option(value))
    return options, unmatched


def vllm_notice(args: GRPOConfig, overrides: dict[str, Any] | None) -> str | None:
    """One line on the vLLM settings that do nothing on Arctic, or None. ``overrides``: the arctic=
    dict of an in-process backend; None for a backend started elsewhere (its sampler was set up
    there)."""
    notes = []
    if args.use_vllm and args.vllm_mode == "server":
        unused = "".join(f", {key} unused" for key in vllm_settings(args, "server"))
        notes.append(f"vllm_mode='server': Arctic's own sampler generates instead of a vLLM server (no "
                     f"`trl vllm-serve` needed){unused}")
    if overrides is None:
        unused = [*vllm_settings(args, "sampler"), *vllm_settings(args, "colocate")]
        reason = "the backend's sampler is configured where the backend runs"
    else:
        backend = overrides.get("sampler", {}).get("backend", SamplerConfig().backend)
        unused, reason = vllm_sampler_options(args, backend)[1], f"the {backend!r} sampler has no such option"
    if unused:
        notes.append(f"{', '.join(unused)} not applied: {reason}")
    return "arctic_trl: " + "; ".join(notes) if notes else None


def unsupported_model(args: GRPOConfig, config: PretrainedConfig) -> list[str]:
    """What the model's config asks of TRL that Arctic does not compute: the MoE load-balancing loss
    TRL adds when the model returns router logits and the coefficient is not 0, and the model's
    dropout, which TRL trains with unless ``disable_dropout``."""
    problems = []
    positions = max_positions(config)
    if args.max_completion_length >= positions:
        problems.append(f"max_completion_length={args.max_completion_length} leaves no room for a prompt in the "
                        f"model's max_position_embeddings={positions}")
    text_config = config.get_text_config()
    coef = args.router_aux_loss_coef
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if hasattr(text_config, "output_router_logits") and coef:
        problems.append(f"router_aux_loss_coef={coef} (the model's MoE load-balancing loss): Arctic does not compute "
                        "it; set router_aux_loss_coef=0.0")
    dropout = {key: value for key, value in text_config.to_dict().items()
               if ("dropout" in key or key.endswith("pdrop")) and type(value) in (int, float) and value > 0}
    if dropout and not args.disable_dropout:
        problems.append(f"the model's dropout {dropout}: Arctic trains without dropout (every forward gives the "
                        "same log-probs); set disable_dropout=True")
    return problems


def truncated_sampling_caveat(args: GRPOConfig) -> str | None:
    """What TRL's vLLM correction (on by default) does with top-k, top-p or min-p sampling: the
    sampler's log-probs are those of the truncated distribution (as vLLM's ``processed_logprobs``),
    the trainer's of the full one, so every ratio is below 1 and a sequence's weight shrinks with
    its length. Arctic does as TRL with vLLM does; the user should know."""
    params = sampling_params(args, args.temperature)
    truncated = [f"{key}={params[key]}" for key, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
                 if params[key] is not None and params[key] != off]
    if not truncated or sampler_correction(args, True) is None:
        return None
    return (f"{', '.join(truncated)} with vllm_importance_sampling_correction: the correction compares the "
            "truncated distribution's log-probs with the full one's, so it down-weights every sample (as TRL "
            "does with vLLM); set vllm_importance_sampling_correction=False to train on the samples as drawn")


def sampling_params(args: GRPOConfig, temperature: float) -> dict[str, Any]:
    """The sampling settings of TRL's generation, as Arctic's ``generate`` arguments."""
    params = {"temperature": temperature, "top_p": args.top_p, "top_k": args.top_k or 0, "min_p": args.min_p or 0.0,
              "repetition_penalty": args.repetition_penalty}
    for key, value in (args.generation_kwargs or {}).items():
        params[GENERATION_KWARGS[key]] = value if value is not None else params[GENERATION_KWARGS[key]]
    return params


@dataclass(frozen=True)
class MicroBatch:
    """What one TRL micro-batch's loss depends on besides its tensors."""

    accumulation_steps: int
    local_tokens: int  # loss-mask tokens of this micro-batch
    num_items_in_batch: float  # TRL's: loss-mask tokens of the whole generation batch
    num_processes: int
    on_policy: bool  # no old log-probs: the data was sampled by exactly these weights
    entropy_floor: float | None = None  # TRL's entropy-mask threshold for this micro-batch
    kept_tokens: int | None = None  # tokens at or above it (the entropy bonus's normaliser)
    entropy_coef: float = 0.0  # the entropy bonus to apply now (TRL's adaptive controller decides)
    sampling_logprobs: bool = False  # the batch carries the sampler's log-probs (TRL's off-policy mask prefers them)


def loss_terms(args: GRPOConfig, micro: MicroBatch) -> tuple[list[dict[str, Any]], int | None]:
    """The loss terms of one micro-batch (weights carry TRL's normalisation per loss type) and the
    response length Dr. GRPO normalises by."""
    aggregation = AGGREGATION[args.loss_type]
    if args.loss_type in WINDOW_NORMALISED:  # a token sum over one accumulation window (all ranks)
        window_tokens = (max(micro.num_items_in_batch, 1.0) / micro.num_processes * micro.accumulation_steps
                         / args.steps_per_generation)
        weight = micro.local_tokens / window_tokens
    else:
        weight = 1.0 / micro.accumulation_steps
    old = "current" if micro.on_policy else "batch"
    terms = [{**_policy(args), "weight": weight, "aggregation": aggregation, "old_logprobs": old,
              "entropy_floor": micro.entropy_floor, "off_policy_threshold": args.off_policy_mask_threshold,
              "off_policy_logprobs": "sampling" if micro.sampling_logprobs else "old",
              "sampler_correction": sampler_correction(args, micro.sampling_logprobs)}]
    if args.beta != 0.0:  # TRL adds beta * k3 per token before normalising: same aggregation, same weight
        terms.append({"name": "kl", "weight": args.beta * weight, "aggregation": aggregation, "estimator": "k3",
                      "clamp": None, "ratio_weighted": args.use_bias_correction_kl,
                      "level": args.importance_sampling_level, "old_logprobs": old})
    # The entropy bonus: a token mean over the kept tokens of the micro-batch, scaled for accumulation.
    # Without one the term has weight 0, a metric only: TRL logs every micro-batch's entropy.
    rescale = 1.0 if micro.kept_tokens is None else micro.local_tokens / max(micro.kept_tokens, 1)
    terms.append({"name": "entropy", "weight": micro.entropy_coef / micro.accumulation_steps * rescale,
                  "aggregation": "token-mean", "entropy_floor": micro.entropy_floor})
    return terms, args.max_completion_length if args.loss_type == "dr_grpo" else None


def policy_loss(args: GRPOConfig, terms: list[dict[str, Any]], metrics: dict[str, float],
                accumulation_steps: int) -> float:
    """TRL's ``policy_loss`` metric from the backend's: the loss without the entropy bonus, before
    TRL divides it by the accumulation steps (the loss types normalised per micro-batch)."""
    part = sum(term["weight"] * metrics[f"{term['name']}/loss"] for term in terms if term["name"] != "entropy")
    return part if args.loss_type in WINDOW_NORMALISED else part * accumulation_steps


def sampler_correction(args: GRPOConfig, sampled: bool) -> dict[str, Any] | None:
    """TRL's correction for vLLM's sampling (``vllm_importance_sampling_*``, on by default), for
    Arctic's sampler: like vLLM an engine apart from the trainer, whose log-probs the batch carries
    (``sampled``)."""
    if not (args.vllm_importance_sampling_correction and sampled):
        return None
    return {"mode": args.vllm_importance_sampling_mode.replace("_", "-"),
            "low": args.vllm_importance_sampling_clip_min, "high": args.vllm_importance_sampling_clip_max}


def _policy(args: GRPOConfig) -> dict[str, Any]:
    """The policy term of ``args.loss_type`` with its own settings."""
    level = args.importance_sampling_level
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if args.loss_type == "cispo":
        return {"name": "cispo", "level": level, "ratio_cap": epsilon_high}
    if args.loss_type == "sapo":
        return {"name": "sapo", "level": level, "temperature_pos": args.sapo_temperature_pos,
                "temperature_neg": args.sapo_temperature_neg}
    if args.loss_type == "vespo":  # its sequence weight comes from the token ratios, whatever the level
        return {"name": "vespo", "k_pos": args.vespo_k_pos, "lambda_pos": args.vespo_lambda_pos,
                "k_neg": args.vespo_k_neg, "lambda_neg": args.vespo_lambda_neg}
    return {"name": "ppo", "level": level, "clip_low": args.epsilon, "clip_high": epsilon_high, "delta": args.delta}


def regroup_is_exact(args: GRPOConfig) -> bool:
    """Whether keeping a prompt's samples in one micro-batch leaves each row's weight in the step as
    TRL's: not when a micro-batch's own statistics normalise or mask (bnpo's token count, the
    entropy bonus's, the entropy mask's quantile), nor when a generation's micro-batches do not fall
    into whole optimizer steps (rows would move to another step)."""
    per_generation, accumulation = args.steps_per_generation, args.gradient_accumulation_steps
    aligned = per_generation % accumulation == 0 or accumulation % per_generation == 0
    return (aligned and args.loss_type != "bnpo" and args.entropy_coef == 0.0 and not args.use_adaptive_entropy
            and args.top_entropy_quantile >= 1.0)


def one_gpu_bf16_trainer(args: GRPOConfig, overrides: dict[str, Any]) -> bool:
    """Whether the backend's DeepSpeed trainer runs bf16 in this one process, with its options and
    the engines' colocation left to the adapter."""
    trainer = overrides.get("trainer", {})
    return (args.bf16 and args.world_size == 1 and not overrides.get("colocate") and "options" not in trainer
            and trainer.get("backend", TrainerConfig().backend) == "deepspeed")


def backend_inputs(model_path: str, args: GRPOConfig, overrides: dict[str, Any]) -> BackendInputs:
    """What TRL's settings say about the in-process backend (``overrides``: the user's ``arctic=``)."""
    extra: dict[str, Any] = {"trainer": {}}
    if args.gradient_checkpointing:
        # TRL checkpoints to fit in memory: recompute only the layers the free memory cannot keep.
        extra["trainer"]["checkpoint_layers"] = "auto"
    if one_gpu_bf16_trainer(args, overrides):
        # DeepSpeed's bf16 optimizer (stage 1) accumulates in fp32 as stage 2 does, and ends each
        # step sooner on one GPU; it cannot sleep, hence not with colocated engines.
        extra["trainer"]["options"] = {"zero_stage": 1}
    return BackendInputs(
        model_path=model_path, dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        device="cpu" if args.use_cpu else "auto",
        optimizer={"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
                   "weight_decay": args.weight_decay, "decay": "transformers",
                   "max_grad_norm": args.max_grad_norm if args.max_grad_norm else None},
        gradient_checkpointing=bool(args.gradient_checkpointing), reference=args.beta != 0.0, seed=args.seed,
        extra=extra)


def arctic_config(model_path: str, args: GRPOConfig, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """An in-process Arctic server for ``model_path`` with TRL's optimizer settings and vLLM
    settings (``VLLM_SETTINGS``), under ``overrides`` (which win). The schedule is TRL's: its
    learning rate is passed with every step."""
    overrides = overrides or {}
    if vllm_settings(args, "colocate"):  # vLLM sleeps while TRL trains: Arctic's engines sleep in turn
        overrides = {"colocate": True, **overrides}
    config = overlay(backend_inputs(model_path, args, overrides).config(), overrides)
    sampler = config.get("sampler", {})
    options = vllm_sampler_options(args, sampler.get("backend", SamplerConfig().backend))[0]
    if options:  # under the user's own sampler options
        config["sampler"] = {**sampler, "options": overlay(options, sampler.get("options", {}))}
    return config


@dataclass(frozen=True)
class TRLRun:
    """What a GRPOTrainer on Arctic is built from: TRL's settings, the model folder, the user's
    ``arctic=`` overrides, and the constructor's arguments Arctic refuses when given."""

    args: GRPOConfig
    model_path: str
    overrides: dict[str, Any]
    peft_config: Any = None
    optimizers: Any = (None, None)


def run_refusals(run: TRLRun, settings: Any = None) -> list[str]:
    """Every setting of the run Arctic cannot reproduce exactly (:func:`unsupported` and the model's)."""
    problems = unsupported(run.args)
    if run.peft_config is not None:
        problems.append(f"peft_config: {reasons.FULL_WEIGHTS}")
    if run.optimizers != (None, None):
        problems.append("optimizers: the optimizer runs in the Arctic backend (configure it in GRPOConfig)")
    return problems + unsupported_model(run.args, AutoConfig.from_pretrained(run.model_path))


class TRLMapping:
    """TRL 1.16's ``GRPOTrainer`` settings in Arctic's terms (see
    :class:`arctic_core.adapters.mapping.FrameworkMapping`); the loss terms depend on each
    micro-batch too."""

    adapter, framework, supported = "arctic-trl", "trl", ("1.16", "1.17")
    owner = "GRPOConfig (model, learning_rate, adam_*, weight_decay, max_grad_norm, gradient_checkpointing)"
    # The backend's loss metrics (``{term}/{metric}``) that are TRL's under another name.
    metric_names = {"kl": "kl/kl", "entropy": "entropy/entropy", "clip_ratio/low_mean": "ppo/clip_low_frac",
                    "clip_ratio/high_mean": "ppo/clip_high_frac", "clip_ratio/low_min": "ppo/clip_low_frac_seq_min",
                    "clip_ratio/high_max": "ppo/clip_high_frac_seq_max", "cispo_clip_ratio": "cispo/capfrac",
                    "vespo/phi_seq_mean": "vespo/phi_mean"}
    refusals = staticmethod(run_refusals)

    @staticmethod
    def loss_terms(run: TRLRun, micro: MicroBatch) -> list[dict[str, Any]]:
        return loss_terms(run.args, micro)[0]

    @staticmethod
    def backend_inputs(run: TRLRun, on_gpu: bool) -> BackendInputs:
        return backend_inputs(run.model_path, run.args, run.overrides)


MAPPING = TRLMapping()
