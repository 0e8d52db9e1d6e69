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
    """``sum_k weight_k * term_k``; metrics come back as ``{term}/{metric}`` plus ``{term}/loss``
    (a name given to several terms: ``kl``, ``kl.2``, ...).

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
        values = []
        for index, ((_, weight, term), label) in enumerate(zip(self.terms, self.labels, strict=True)):
            value, term_metrics = term(outputs, batch, ctx)
            values.append(value)
            if weight != 0.0 or (total is None and index == len(self.terms) - 1):
                total = weight * value if total is None else total + weight * value
            metrics[f"{label}/loss"] = value.detach()
            metrics.update({f"{label}/{k}": v for k, v in term_metrics.items()})
        assert total is not None  # build_objective refuses an empty list
        if torch.is_grad_enabled() and not total.requires_grad:
            raise RequestError(self._no_gradient(outputs, values))
        metrics["loss"] = total.detach()
        return total, metrics

    @property
    def labels(self) -> list[str]:
        """Each term's metric prefix: its name, numbered from its second use (``kl``, ``kl.2``)."""
        seen: dict[str, int] = {}
        labels = []
        for name, _, _ in self.terms:
            seen[name] = seen.get(name, 0) + 1
            labels.append(name if seen[name] == 1 else f"{name}.{seen[name]}")
        return labels

    def _no_gradient(self, outputs: Mapping[str, torch.Tensor], values: list[torch.Tensor]) -> str:
        """Why a training loss has no gradient (a backward of it would fail naming nothing)."""
        detached = sorted(name for name, value in outputs.items() if not value.requires_grad)
        if detached:
            return (f"the loss has no gradient: the processors' outputs {detached} do not depend on the weights "
                    "(computed under torch.no_grad or detached): a processor must keep the autograd graph")
        constant = [label for label, (_, weight, _), value in zip(self.labels, self.terms, values, strict=True)
                    if weight != 0.0 and not value.requires_grad]
        return (f"the loss has no gradient: loss term(s) {constant} returned a loss that does not depend on the "
                "outputs it reads (detached, or a constant)")

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
    if bad:
        return f"returned metrics {bad} that are not 0-dim tensors or numbers"
    if "loss" in metrics:
        return "returned a metric named 'loss' (the term's loss is reported as '<term>/loss')"
    return None


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
    producers: dict[str, str] = {}
    for name in dict.fromkeys(names):
        factory = registry.get("processor", name)
        try:
            processor = factory(temperature=temperature)
        except TypeError as exc:  # a plugin's processor that does not take the temperature
            raise RequestError(f"processor {name!r} cannot be built as processors are, with temperature=: "
                               f"{exc}") from exc
        outputs = getattr(processor, "outputs", None)
        if not (isinstance(outputs, (tuple, list)) and outputs and all(isinstance(o, str) for o in outputs)):
            raise RequestError(f"processor {name!r} declares outputs {outputs!r}: a processor names what it "
                               "returns, e.g. outputs = ('logprobs',)")
        for output in outputs:
            if output in producers:  # one would silently replace the other's values
                raise RequestError(f"processors {producers[output]!r} and {name!r} both produce {output!r}")
            producers[output] = name
            out[output] = processor
    return out


def check_processor_outputs(processor: Processor, produced: object, tokens: int) -> None:
    """A processor returns ``{output: [N] float tensor}`` for exactly the outputs it declares;
    anything else is named with the rule (it would fail as a bare shape or key error, or come back
    as zeros)."""
    what = f"processor {type(processor).__name__} (outputs {tuple(processor.outputs)})"
    if not isinstance(produced, Mapping) or set(produced) != set(processor.outputs):
        found = sorted(produced) if isinstance(produced, Mapping) else type(produced).__name__
        raise RequestError(f"{what} returned {found}: a processor returns a dict of exactly its declared outputs")
    for output, value in produced.items():
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and tuple(value.shape) == (tokens,)):
            raise RequestError(f"{what} returned {output!r} as {_kind(value)}"
                               f"{f' of {value.dtype}' if isinstance(value, torch.Tensor) else ''}: each output is a "
                               f"float tensor of shape [N] = [{tokens}], one value per token (e.g. gathered at "
                               "the targets)")


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
