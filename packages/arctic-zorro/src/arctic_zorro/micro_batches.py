"""Running one call micro-batch by micro-batch: planning under a token budget, stitching outputs.

Shared by every training / log-prob engine: an engine supplies its forward (``micro, processors ->
outputs``) and, for training, its backward; the loss normalisers come from the whole call
(``LossContext``), so the micro-batch split never changes the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.host_copy import HostCopy
from arctic_core.losses.aggregation import add_metrics
from arctic_core.plugins.interfaces import LossContext, Metrics, Objective, Processor

MicroForward = Callable[[RolloutBatch, Mapping[str, Processor]], dict[str, torch.Tensor]]
# Given this rank's micro-batch count, the count every rank runs (the busiest rank's): under ZeRO-3
# each forward gathers parameters with all ranks, so a rank that stopped early would hang the rest.
Align = Callable[[int], int]


def plan_micro_batches(batch: RolloutBatch, token_budget: int, grouped: bool = False) -> list[list[int]]:
    """Row lists, one per micro-batch, each within ``token_budget`` where possible.

    ``grouped`` (the packed forward): cost is the deduplicated token count and a prompt's group
    stays in one micro-batch, so its prompt is packed once; a group over the budget alone is split
    into chunks of responses (each chunk carries the prompt once). Otherwise (the padded forward):
    consecutive rows, cost = rows x longest row. A single row over the budget still gets its own
    micro-batch: correctness over the budget.
    """
    if not grouped:
        return _padded_plan(batch, token_budget)
    units = [chunk for rows in batch.groups() if rows for chunk in _split_group(batch, rows, token_budget)]
    units.sort(key=lambda rows: -forest_cost(batch, rows))  # first-fit decreasing: few, full micro-batches
    bins: list[tuple[int, list[int]]] = []
    for rows in units:
        cost = forest_cost(batch, rows)
        for i, (used, members) in enumerate(bins):
            if used + cost <= token_budget:
                bins[i] = (used + cost, members + rows)
                break
        else:
            bins.append((cost, list(rows)))
    return [sorted(members) for _, members in bins]


def forest_cost(batch: RolloutBatch, rows: list[int]) -> int:
    """Packed tokens of ``rows`` if each distinct prompt is stored once (shared response prefixes
    and prompts that prefix each other make the real forest smaller still)."""
    prompts = {int(batch.prompt_index[r]) for r in rows}
    return int(sum(int(batch.prompt_lens[p]) for p in prompts) + batch.response_lens[rows].sum())


def micro_batch_tokens(batch: RolloutBatch, grouped: bool) -> int:
    """Tokens the forward runs for all of ``batch``: deduplicated (``grouped``) or padded rows."""
    if grouped:
        return forest_cost(batch, list(range(batch.num_responses)))
    return batch.num_responses * int(batch.sequence_lens().max())


def _split_group(batch: RolloutBatch, rows: list[int], token_budget: int) -> list[list[int]]:
    """A group as chunks of its responses whose cost (prompt + responses) fits the budget."""
    prompt = int(batch.prompt_lens[batch.prompt_index[rows[0]]])
    chunks: list[list[int]] = [[]]
    used = prompt
    for row in rows:
        length = int(batch.response_lens[row])
        if chunks[-1] and used + length > token_budget:
            chunks.append([])
            used = prompt
        chunks[-1].append(row)
        used += length
    return chunks


def _padded_plan(batch: RolloutBatch, token_budget: int) -> list[list[int]]:
    lengths = batch.sequence_lens().tolist()
    plans: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row, length in enumerate(lengths):
        wider = max(longest, length)
        if current and wider * (len(current) + 1) > token_budget:
            plans.append(current)
            current, wider = [], length
        current.append(row)
        longest = wider
    if current:
        plans.append(current)
    return plans


def assemble_outputs(
    batch: RolloutBatch, parts: list[tuple[list[int], dict[str, torch.Tensor]]], names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Stitch micro-batch outputs back into ``[B, Lr]`` tensors in the batch's row order: one per
    output of ``names``, also when no micro-batch ran (a batch of no responses: ``[0, 0]``)."""
    out: dict[str, torch.Tensor] = {}
    for rows, outputs in parts:
        for name, values in outputs.items():
            full = out.setdefault(name, torch.zeros(tuple(batch.response_ids.shape), dtype=values.dtype))
            full[rows, : values.shape[1]] = values.cpu()
    for name in names:
        out.setdefault(name, torch.zeros(tuple(batch.response_ids.shape)))
    return out


@torch.no_grad()
def micro_log_probs(
    forward: MicroForward, batch: RolloutBatch, processors: Mapping[str, Processor], token_budget: int, grouped: bool,
    align: Align | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token outputs of the whole batch, computed one micro-batch at a time."""
    plan = plan_micro_batches(batch, token_budget, grouped)
    parts = [(rows, forward(batch.select(rows), processors)) for rows in plan]
    for _ in range(_idle_passes(plan, align)):  # join the other ranks' gathers; outputs unused
        forward(batch.select(plan[0]), processors)
    return assemble_outputs(batch, parts, processors)


def _idle_passes(plan: list[list[int]], align: Align | None) -> int:
    if align is None:
        return 0
    extra = align(len(plan)) - len(plan)
    if extra and not plan:
        raise RuntimeError("a rank with no rows cannot join the other ranks' ZeRO-3 forwards")
    return extra


def micro_forward_backward(
    forward: MicroForward,
    backward: Callable[[torch.Tensor], object],
    batch: RolloutBatch,
    objective: Objective,
    ctx: LossContext,
    scale: float,
    token_budget: int,
    grouped: bool,
    device: torch.device,
    align: Align | None = None,
) -> dict[str, float]:
    """Accumulate ``scale * loss`` gradients over the micro-batches; metrics summed (ctx-normalised).

    With ``align``, a rank with fewer micro-batches than the busiest runs idle passes: its first
    micro-batch again with the loss times zero (no gradient, but every collective joined)."""
    totals: Metrics = {}
    plan = plan_micro_batches(batch, token_budget, grouped)
    idle = _idle_passes(plan, align)
    for i, rows in enumerate(plan + plan[:1] * idle):
        host = batch.select(rows)  # forwards index on the host: give them the host copy (no round trip)
        micro = host.to(device)
        loss, metrics = objective(forward(host, objective.processors), micro, ctx)
        if i >= len(plan):
            backward(loss * 0.0)
            continue
        add_metrics(totals, metrics)  # on the device: summed without reading them
        if i == len(plan) - 1:
            reading = MetricsReading(totals)
        backward(loss * scale)
    return reading.values() if plan else {}


class MetricsReading:
    """Metrics copied to the host behind the work queued so far, read later.

    The copy is queued before the last backward, so reading waits for the forward only: the call
    returns while its backward still runs, and no micro-batch's backward waited for the host to
    read a value (reading each micro-batch's metrics as floats left the device idle between
    forward and backward: docs/design/zorro.md)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = dict(metrics)
        self.on_device = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
        self.copy: HostCopy | None = None
        if self.on_device:
            device = metrics[self.on_device[0]].device
            self.copy = HostCopy(torch.stack([metrics[k].detach().float().reshape(()).to(device)
                                              for k in self.on_device]))

    def values(self) -> dict[str, float]:
        read = dict(zip(self.on_device, self.copy.tolist(), strict=True)) if self.copy is not None else {}
        return {k: read[k] if k in read else float(v) for k, v in self.metrics.items()}
