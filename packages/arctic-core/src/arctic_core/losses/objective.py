"""A training objective: named loss terms with weights, plus the processors they read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.config import LossTermConfig
from arctic_core.errors import RequestError
from arctic_core.plugins.interfaces import LossContext, LossTerm, Metrics, Processor
from arctic_core.plugins.registry import Registry


@dataclass
class WeightedObjective:
    """``sum_k weight_k * term_k``; metrics come back as ``{term}/{metric}`` plus ``{term}/loss``.

    A term of weight 0 is a metric only: computed and reported, but left out of the sum, so no
    backward runs through it (an entropy to log costs its forward alone). A list whose weights are
    all 0 still yields a loss (zero times the last term) whose backward reaches the weights."""

    terms: list[tuple[str, float, LossTerm]]
    processors: Mapping[str, Processor]
    spec: tuple[list[LossTermConfig], float] | None = None  # what it was built from: rebuildable elsewhere

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, Metrics]:
        total: torch.Tensor | None = None
        metrics: Metrics = {}
        for index, (name, weight, term) in enumerate(self.terms):
            value, term_metrics = term(outputs, batch, ctx)
            if weight != 0.0 or (total is None and index == len(self.terms) - 1):
                total = weight * value if total is None else total + weight * value
            metrics[f"{name}/loss"] = value.detach()
            metrics.update({f"{name}/{k}": v for k, v in term_metrics.items()})
        assert total is not None  # build_objective refuses an empty list
        metrics["loss"] = total.detach()
        return total, metrics

    @torch.no_grad()
    def check(self, batch: RolloutBatch, ctx: LossContext) -> None:
        """Raise what the terms would raise on ``batch`` (a missing field, a wrong shape) before
        any engine computes: a dry run on zero placeholders of every output the terms read.
        A call refused here has touched no gradient. A term that breaks the loss contract (see
        :func:`check_term_result`) is named here too, rather than failing inside a backward."""
        placeholders = {name: torch.zeros(batch.response_ids.shape) for name in self.processors}
        for name, _, term in self.terms:
            check_term_result(name, term(placeholders, batch, ctx))


def check_term_result(name: str, result: object) -> None:
    """A loss term returns ``(loss, metrics)``: a 0-dim tensor and a dict of 0-dim tensors or numbers."""
    problem = _contract_problem(result)
    if problem:
        raise RequestError(f"loss term {name!r} {problem}: a term returns (0-dim loss tensor, "
                           "{metric: 0-dim tensor or number})")


def _contract_problem(result: object) -> str | None:
    if not (isinstance(result, tuple) and len(result) == 2):
        return f"returned {_kind(result)}, not a pair (loss, metrics)"
    loss, metrics = result
    if not _is_scalar_tensor(loss):
        return f"returned a loss that is {_kind(loss)}, not a 0-dim tensor (aggregate the tokens' losses)"
    if not isinstance(metrics, Mapping):
        return f"returned metrics that are {_kind(metrics)}, not a dict"
    bad = [key for key, value in metrics.items() if not (isinstance(value, (int, float)) or _is_scalar_tensor(value))]
    return f"returned metrics {bad} that are not 0-dim tensors or numbers" if bad else None


def _is_scalar_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


class ProcessorSet(dict):
    """Processors keyed by each output they produce, remembering the plugin names and temperature
    they were built from (so another process can build the same set)."""

    def __init__(self, names: Sequence[str], temperature: float) -> None:
        super().__init__()
        self.names, self.temperature = list(names), temperature


def build_processors(registry: Registry, names: Sequence[str], temperature: float) -> ProcessorSet:
    """Instantiate the named processors at ``temperature``, keyed by each output they produce."""
    out = ProcessorSet(list(dict.fromkeys(names)), temperature)
    for name in dict.fromkeys(names):
        factory = registry.get("processor", name)
        try:
            processor = factory(temperature=temperature)
        except TypeError as exc:  # a plugin's processor that does not take the temperature
            raise RequestError(f"processor {name!r} cannot be built as processors are, with temperature=: "
                               f"{exc}") from exc
        for output in processor.outputs:
            out[output] = processor
    return out


def build_objective(
    registry: Registry, terms: Sequence[LossTermConfig], temperature: float = 1.0
) -> WeightedObjective:
    """Resolve loss terms by plugin name and the processors they require."""
    if not terms:
        raise RequestError("fwd_bwd needs at least one loss term, e.g. [{'name': 'ppo'}]")
    built = [(t.name, t.weight, registry.get("loss", t.name)(**t.options())) for t in terms]
    for name, _, term in built:
        if not isinstance(getattr(term, "requires", None), (tuple, list)):
            raise RequestError(f"loss term {name!r} declares no `requires`: the processors whose outputs it "
                               "reads, e.g. requires = ('logprobs',)")
    names = [name for _, _, term in built for name in term.requires]
    return WeightedObjective(built, build_processors(registry, names, temperature), (list(terms), temperature))
