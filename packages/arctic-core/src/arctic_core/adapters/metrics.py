"""Arctic's metrics under a framework's names.

The backend reports each loss term's metrics as ``{term}/{metric}`` (``ppo/clipfrac``,
``kl/loss``, ``entropy/loss``). Where a framework logs the same quantity under a name of its own,
an adapter's mapping lists it (``metric_names``) and :func:`framework_metrics` copies the value
across; every metric also stays under ``arctic/``.
"""

from __future__ import annotations

from collections.abc import Mapping

from arctic_core.losses.aggregation import add_metrics

POLICY = "{policy}"
"""Stands for the policy term's name (``ppo``, ``gspo``, ``cispo``, ...) in a metric-name mapping."""
ENTROPY = "-entropy/loss"
"""The entropy the bonus term measured: its loss minimises the negative entropy, so the sign flips."""


def framework_metrics(metrics: Mapping[str, float], names: Mapping[str, str], policy: str) -> dict[str, float]:
    """The framework's names (``names``' keys) for the metrics present, each from the Arctic metric
    its value names (with ``{policy}`` the policy term's name; a leading ``-`` flips the sign)."""
    out = {}
    for theirs, ours in names.items():
        sign, key = (-1.0, ours[1:]) if ours.startswith("-") else (1.0, ours)
        key = key.replace(POLICY, policy)
        if key in metrics:
            out[theirs] = sign * metrics[key]
    return out


def prefixed(metrics: Mapping[str, float], prefix: str = "arctic/") -> dict[str, float]:
    return {prefix + key: value for key, value in metrics.items()}


def mean_over_calls(results: list[Mapping[str, float]]) -> dict[str, float]:
    """Several calls' metrics (a step's mini-batches) as one: each the mean, extremes the extreme."""
    reduced: dict[str, float] = {}
    for result in results:
        add_metrics(reduced, result, 1.0 / len(results))
    return reduced
