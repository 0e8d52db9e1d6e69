"""An example third-party Arctic plugin: one loss and one post-forward processor.

Everything a plugin needs is here plus one entry point in its pyproject.toml::

    [project.entry-points.arctic]
    example = "arctic_example_plugin"
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from arctic_core.plugins import LossContext, RolloutBatch, StrictModel, aggregate, hookimpl, validate


class ReinforceOptions(StrictModel):
    baseline: float = 0.0
    """Subtracted from every advantage."""


class Reinforce:
    """Vanilla REINFORCE: -advantage * log-prob, token-mean (no ratio, no clipping)."""

    options_model = ReinforceOptions  # listed by `arctic-rl config-reference`
    requires = ("logprobs",)

    def __init__(self, **options: object) -> None:
        # Validated rather than taken as keyword arguments: a typo ("basline") is then a ConfigError
        # naming the option and the closest valid one, not a TypeError from inside the server.
        self.options = validate(ReinforceOptions, options, "options of loss 'reinforce'")

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        adv = batch.token_advantages().to(outputs["logprobs"]) - self.options.baseline
        return aggregate(-adv * outputs["logprobs"], batch.loss_mask, ctx, "token-mean"), {}


class Top1Match:
    """1.0 where the target token is the model's most likely token, else 0.0 (greedy agreement)."""

    outputs = ("top1_match",)

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature  # argmax does not depend on it; accepted like every processor

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"top1_match": (logits.argmax(-1) == targets).float()}


@hookimpl
def arctic_losses():
    return {"reinforce": Reinforce}


@hookimpl
def arctic_processors():
    return {"top1_match": Top1Match}
