"""GRPOConfig -> Arctic: which TRL knobs we honour, how they become loss terms, and which we refuse.

TRL computes rewards and advantages; Arctic runs generation, log-probs, the loss with its backward
and the optimizer step. The loss terms below reproduce ``GRPOTrainer._compute_loss`` of TRL 1.16
term by term (clipped surrogate, k3 KL, entropy bonus) with the same normalisation per loss type,
so a micro-batch's loss and gradients are TRL's.
"""

from __future__ import annotations

from typing import Any

from trl import GRPOConfig

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# loss_type -> (our aggregation, normalised per accumulation step by GA as TRL does)
AGGREGATION = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
               "dapo": "token-mean"}


def unsupported(args: GRPOConfig) -> list[str]:
    """The settings of ``args`` Arctic cannot reproduce exactly, each with what to do instead."""
    problems = []
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        problems.append(f"loss_type={args.loss_type!r} (supported: {', '.join(SUPPORTED_LOSS_TYPES)})")
    if args.importance_sampling_level == "sequence" and args.loss_type != "grpo":
        problems.append("importance_sampling_level='sequence' (GSPO) needs loss_type='grpo'")
    checks = {
        "use_vllm": (args.use_vllm, "Arctic samples for you: drop use_vllm"),
        "delta": (args.delta is not None, "two-sided clipping (delta) is not implemented: leave delta=None"),
        "top_entropy_quantile": (args.top_entropy_quantile < 1.0, "entropy masking is not implemented: use 1.0"),
        "use_adaptive_entropy": (args.use_adaptive_entropy, "adaptive entropy is not implemented"),
        "off_policy_mask_threshold": (args.off_policy_mask_threshold is not None, "off-policy masking is not implemented"),
        "min_p": (args.min_p is not None, "the Arctic samplers have no min-p: leave it None"),
        "repetition_penalty": (args.repetition_penalty != 1.0, "the Arctic samplers have no repetition penalty"),
        "generation_kwargs": (bool(args.generation_kwargs), "pass sampling settings as GRPOConfig fields instead"),
        "use_bias_correction_kl": (args.beta != 0.0 and args.use_bias_correction_kl,
                                   "with beta != 0 set use_bias_correction_kl=False (the KL is not ratio-weighted)"),
    }
    problems += [f"{name}: {why}" for name, (bad, why) in checks.items() if bad]
    return problems


def loss_terms(args: GRPOConfig, *, accumulation_steps: int, local_tokens: int, num_items_in_batch: float,
               num_processes: int, on_policy: bool) -> tuple[list[dict[str, Any]], int | None]:
    """The loss terms of one micro-batch (weights carry TRL's per-loss-type normalisation) and the
    response length Dr. GRPO normalises by."""
    aggregation = AGGREGATION[args.loss_type]
    if args.loss_type == "dapo":  # token sum over the tokens of one accumulation window (all ranks)
        window_tokens = max(num_items_in_batch, 1.0) / num_processes * accumulation_steps / args.steps_per_generation
        weight = local_tokens / window_tokens
    else:
        weight = 1.0 / accumulation_steps
    policy = {
        "name": "gspo" if args.importance_sampling_level == "sequence" else "ppo",
        "weight": weight,
        "aggregation": aggregation,
        "clip_low": args.epsilon,
        "clip_high": args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        "old_logprobs": "current" if on_policy else "batch",
    }
    terms = [policy]
    if args.beta != 0.0:  # TRL adds beta * k3 per token before normalising: same aggregation, same weight
        terms.append({"name": "kl", "weight": args.beta * weight, "aggregation": aggregation, "estimator": "k3",
                      "clamp": None})
    if args.entropy_coef != 0.0:  # a token mean per micro-batch, scaled for accumulation only
        terms.append({"name": "entropy", "weight": args.entropy_coef / accumulation_steps, "aggregation": "token-mean"})
    return terms, args.max_completion_length if args.loss_type == "dr_grpo" else None


def arctic_config(model_path: str, args: GRPOConfig, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """An in-process Arctic server for ``model_path`` with TRL's optimizer settings. The schedule is
    TRL's: its learning rate is passed with every step."""
    device = "cpu" if args.use_cpu else "auto"
    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    config: dict[str, Any] = {
        "model": {"path": model_path, "dtype": dtype, "device": device},
        "seed": args.seed,
        "trainer": {
            "optimizer": {"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
                          "weight_decay": args.weight_decay,
                          "max_grad_norm": args.max_grad_norm if args.max_grad_norm else None},
            "gradient_checkpointing": bool(args.gradient_checkpointing),
        },
    }
    if args.beta != 0.0:
        config["reference"] = {}
    for key, value in (overrides or {}).items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config
