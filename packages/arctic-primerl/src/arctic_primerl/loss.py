"""PRIME-RL's ``[trainer.loss]`` as Arctic loss terms.

PRIME-RL's default loss (DPPO-Binary TV with Kimi K2.5's KL) and its IPO variant are, per token,
``-keep * adv_tau * A * ratio + kl_tau * log(ratio)^2`` with the ratio against the sampler's
log-probs; they are Arctic's core ``dppo`` term plus ``kl`` against the old (sampling) policy.
PRIME-RL sums each token's loss over the whole step and divides by the step's count of trainable
tokens; Arctic's terms sum (``token-sum``) and each ``fwd_bwd`` call is scaled by one over that count,
so a step split into several calls (several temperatures) is normalised as one.
"""

from __future__ import annotations

from typing import Any

from arctic_core.errors import ConfigError

DEFAULTS = {
    "default": {"dppo_mask_low": 0.2, "dppo_mask_high": 0.2, "adv_tau": 1.0, "kl_tau": 1e-3},
    "ipo": {"ipo_threshold": 0.1, "adv_tau": 1.0, "kl_tau": 1e-3},
}


def loss_terms(loss: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Arctic loss terms for PRIME-RL's ``trainer.loss`` table (its defaults where keys are absent)."""
    loss = dict(loss or {})
    kind = loss.pop("type", "default")
    if kind not in DEFAULTS:
        raise ConfigError(f"trainer.loss.type = {kind!r} is not supported by arctic-primerl (it runs 'default' and "
                          "'ipo'); a custom loss function would run inside PRIME-RL's own trainer")
    unknown = sorted(set(loss) - set(DEFAULTS[kind]))
    if unknown:
        raise ConfigError(f"trainer.loss: unknown key(s) {unknown} for type {kind!r}; known: {sorted(DEFAULTS[kind])}")
    opts = {**DEFAULTS[kind], **loss}
    if kind == "default":
        region = {"mask_low": opts["dppo_mask_low"], "mask_high": opts["dppo_mask_high"],
                  "trust_region": "advantage-sign"}
    else:
        region = {"mask_low": opts["ipo_threshold"], "mask_high": opts["ipo_threshold"], "trust_region": "both-sides"}
    terms = [{"name": "dppo", "weight": opts["adv_tau"], "aggregation": "token-sum", **region}]
    if opts["kl_tau"]:  # k2 is log(ratio)^2 / 2
        terms.append({"name": "kl", "weight": 2 * opts["kl_tau"], "against": "old", "estimator": "k2",
                      "clamp": None, "aggregation": "token-sum"})
    # PRIME-RL's trainer reports the entropy of every step: a term of weight 0, a metric only.
    terms.append({"name": "entropy", "weight": 0.0, "aggregation": "token-sum"})
    return terms
