"""A plugin as arctic-core 0.1.0 documented them, frozen: its imports are that release's
(``arctic_core.hookspecs``, ``arctic_core.interfaces``) and its loss takes its option as a keyword,
as the example plugin of that release did. Only the names it registers (and its processor's
output) differ from that example's, so both can be installed together. Leave it as it is: it
checks that such a plugin keeps loading and computing (tests/test_plugin_api.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.hookspecs import hookimpl
from arctic_core.interfaces import LossContext
from arctic_core.losses.aggregation import aggregate


class Reinforce:
    """Vanilla REINFORCE: -advantage * log-prob, token-mean (no ratio, no clipping)."""

    requires = ("logprobs",)

    def __init__(self, baseline: float = 0.0) -> None:
        self.baseline = baseline

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        adv = batch.token_advantages().to(outputs["logprobs"]) - self.baseline
        return aggregate(-adv * outputs["logprobs"], batch.loss_mask, ctx, "token-mean"), {}


class Top1Match:
    """1.0 where the target token is the model's most likely token, else 0.0 (greedy agreement)."""

    outputs = ("first_api_top1_match",)

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature  # argmax does not depend on it; accepted like every processor

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"first_api_top1_match": (logits.argmax(-1) == targets).float()}


@hookimpl
def arctic_losses():
    return {"first_api_reinforce": Reinforce}


@hookimpl
def arctic_processors():
    return {"first_api_top1_match": Top1Match}
