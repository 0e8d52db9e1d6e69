"""What the products of each plugin kind must do (structural protocols; no base classes).

Tensor conventions shared by every backend:
- per-token outputs are ``[B, Lr]`` float32 tensors aligned with ``RolloutBatch.response_ids``
  (row order of the batch, zeros at padding);
- ``outputs["logprobs"][i, j]`` is ``log p(response_ids[i, j] | prompt_i, response_ids[i, :j])``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.config import SamplingParams

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class LossContext:
    """Normalisers over the *whole* ``fwd_bwd`` call, so splitting it into micro-batches is exact.

    Loss terms must divide by these (never by micro-batch counts), and report metrics that add up
    across micro-batches.
    """

    num_tokens: int
    """Loss-mask tokens in the whole call (token-mean aggregation)."""
    num_sequences: int
    """Responses in the whole call (sequence-mean aggregation)."""
    max_response_len: int
    """Constant length for Dr.GRPO-style token-sum normalisation."""

    @classmethod
    def of(cls, batch: RolloutBatch, max_response_len: int | None = None) -> LossContext:
        return cls(
            num_tokens=max(int(batch.loss_mask.sum()), 1),
            num_sequences=max(batch.num_responses, 1),
            max_response_len=max(max_response_len or batch.response_ids.shape[1], 1),
        )


@runtime_checkable
class Processor(Protocol):
    """Turns logits at response positions into per-token outputs.

    ``__call__(logits [N, V] float, targets [N] int64) -> {output_name: [N] tensor}``. Outputs must
    stay differentiable when the loss needs their gradient (e.g. entropy bonus).
    """

    outputs: tuple[str, ...]

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]: ...


Metrics = dict[str, float | torch.Tensor]
"""A loss term's additive metrics: floats, or 0-dim tensors on the device, which the engine sums
there and reads once per call, after its last backward is queued (a float read inside the term
makes the device wait for the host between each micro-batch's forward and backward). A name
ending in ``_min`` or ``_max`` is an extreme instead: the smallest or largest over micro-batches
and ranks (NaN, a part without a value, ignored); see ``arctic_core.losses.aggregation``."""


@runtime_checkable
class LossTerm(Protocol):
    """One term of a training objective.

    ``requires`` names the per-token outputs (processor names) it reads. ``__call__`` returns the
    term's scalar loss for this micro-batch, normalised by ``ctx``, and additive :data:`Metrics`.
    """

    requires: tuple[str, ...]

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, Metrics]: ...


class Objective(Protocol):
    """What a training backend receives from the server: composed loss terms plus processors."""

    processors: Mapping[str, Processor]

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: RolloutBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, Metrics]: ...


class LogProbBackend(Protocol):
    """Forward-only engine: per-token outputs of a fixed set of weights."""

    def log_probs(self, batch: RolloutBatch, processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]: ...
    def load_weights(self, weights: NamedTensors) -> None: ...
    def sleep(self) -> None: ...
    def wake(self) -> None: ...
    def shutdown(self) -> None: ...


class TrainingBackend(LogProbBackend, Protocol):
    """Trainable policy: gradients accumulate across ``forward_backward`` calls until ``optimizer_step``."""

    def forward_backward(
        self, batch: RolloutBatch, objective: Objective, ctx: LossContext, scale: float = 1.0
    ) -> dict[str, float]: ...
    def optimizer_step(self, lr: float | None = None) -> dict[str, float]: ...
    def discard_gradients(self) -> None:
        """Forget the gradients accumulated since the last step (after a ``forward_backward`` that
        failed part-way, whose partial sum must not reach the next step)."""
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...
    def save_checkpoint(self, path: Path) -> None: ...
    def load_checkpoint(self, path: Path) -> None: ...
    def export_hf(self, path: Path) -> None:
        """Write the current policy as a Hugging Face folder (``from_pretrained`` loads it)."""


class SamplingBackend(Protocol):
    """Generates ``params.n`` responses per prompt; results carry the policy version used."""

    policy_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch: ...
    def update_weights(self, weights: NamedTensors, version: int) -> None: ...
    def sleep(self) -> None: ...
    def wake(self) -> None: ...
    def shutdown(self) -> None: ...


class PendingGeneration(Protocol):
    """A generate request in a sampler's batch."""

    def wait(self, timeout: float | None = None) -> RolloutBatch:
        """The samples once all have finished (the sampler's error if the request failed)."""
        ...

    def cancel(self) -> None:
        """Stop the request: its samples leave the batch and give their memory back."""
        ...


@runtime_checkable
class ConcurrentSampling(Protocol):
    """A sampling backend that batches requests from many threads: ``submit`` puts one in line and
    returns at once; the server then runs generate calls side by side (a backend without it gets
    one generate call at a time)."""

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> PendingGeneration: ...


class WeightReceiver(Protocol):
    def update_weights(self, weights: NamedTensors, version: int) -> None: ...


class WeightTransport(Protocol):
    """Moves the trainer's weights into every receiver and stamps them with ``version``."""

    def sync(self, source: TrainingBackend, receivers: list[WeightReceiver], version: int) -> dict[str, float]: ...


class BroadcastSource(Protocol):
    """A training backend whose ranks live in Ray actors, as the sender of a weight sync
    between actors (``torch-broadcast``, ``cuda-ipc``)."""

    def weight_group_members(self) -> list[Any]:
        """The actor that sends (rank 0), first; its class mixes in ``WeightSyncActor``."""
        ...

    def start_weight_send(self, method: str, *args: Any) -> list[Any]:
        """Calls ``method(*args)`` on the sender, plus whatever the other ranks must do alongside
        (e.g. join ZeRO-3 gathers); returns the ObjectRefs, the sender's first."""
        ...


class BroadcastReceiver(Protocol):
    """A sampling backend whose replicas live in Ray actors, as receivers of such a sync."""

    def weight_group_members(self) -> list[Any]: ...

    def start_weight_receive(self, version: int, method: str, *args: Any) -> list[Any]:
        """Calls ``method(*args)`` on every member to take weights ``version``; returns the ObjectRefs."""
        ...
