"""The ``ray`` training backend: any data-parallel training backend, one Ray actor per rank.

``trainer: {backend: ray, options: {workers: 2, backend: deepspeed, options: {zero_stage: 2}}}``
starts (or joins, with ``address``) a Ray cluster and runs ``workers`` copies of the inner backend
as torch.distributed ranks (NCCL when each rank has a GPU of its own, gloo on the CPU or when ranks
share a GPU; DeepSpeed shards optimizer state and gradients over them). The server sees one
training backend, so every client call works unchanged.

- ``forward_backward`` splits the batch by whole prompt groups (a group's shared prompt stays on
  one rank, as ZoRRo needs), balanced by tokens; every rank normalises by the GLOBAL loss context,
  and its loss is scaled by the world size because the inner engine averages gradients over ranks.
  The gradients then equal one rank's on the whole batch.
- ``optimizer_step`` and every stateful call (checkpoints, sleep/wake, weights) run on all ranks:
  they may be collectives. Results come from rank 0.
- Requests travel to the workers in the wire format (safetensors + JSON), as over HTTP.

A dead worker raises :class:`~arctic_core.errors.WorkerError` naming its rank; the server stays up,
``/health`` says "degraded", and ``load_checkpoint`` restarts all ranks from a checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from arctic_core import wire
from arctic_core.batch import RolloutBatch
from arctic_core.config import ModelConfig, TrainerConfig, validate_options
from arctic_core.errors import RequestError, WorkerError
from arctic_core.losses.aggregation import add_metrics
from arctic_core.plugins.interfaces import LossContext, NamedTensors, Objective, Processor
from arctic_core.ports import free_port
from arctic_core.protocol import FwdBwdRequest
from arctic_core.ray.actors import (InnerBackendOptions, build_inner, ensure_ray, log_probs_request, named_tensors,
                                    require_resources, run_log_probs, task_error, weights_blob)
from arctic_core.weights.actor import WeightSyncActor


class RayTrainerOptions(InnerBackendOptions):
    workers: int = Field(2, ge=1, description="Data-parallel ranks, one Ray actor each.")
    backend: str = Field("deepspeed", description="The training backend every worker runs.")
    gpus_per_worker: float = Field(0.0, ge=0, description="1 per worker for a GPU each; fractions to colocate.")
    cpus_per_worker: float = Field(1.0, ge=0, description="CPUs Ray reserves per worker (its compute threads).")
    comm_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="The ranks' torch.distributed backend. auto: NCCL when each rank has whole GPUs of "
        "its own, gloo on the CPU or when ranks share a GPU (NCCL refuses two ranks on one device).")

    @model_validator(mode="after")
    def _nccl_needs_own_gpus(self) -> RayTrainerOptions:
        if self.comm_backend == "nccl" and self.gpus_per_worker < 1:
            raise ValueError("comm_backend 'nccl' needs gpus_per_worker >= 1: NCCL refuses ranks without a GPU "
                             "of their own; use 'gloo' (or 'auto')")
        return self

    @property
    def resolved_comm_backend(self) -> str:
        if self.comm_backend != "auto":
            return self.comm_backend
        return "nccl" if self.gpus_per_worker >= 1 else "gloo"


class TrainerWorker(WeightSyncActor):
    """One rank (a Ray actor): the inner training backend in its own process. Rank 0 is the
    sender of ``torch-broadcast`` weight syncs."""

    def __init__(self, rank: int, world: int, port: int, comm_backend: str, backend: str, config_json: str,
                 model_json: str, seed: int) -> None:
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        # The group is made here, with the backend the placement needs; the inner backend (DeepSpeed)
        # joins a group that exists instead of picking NCCL for any CUDA device.
        if comm_backend == "nccl":
            torch.cuda.set_device(0)  # Ray shows each rank only its own GPUs
        torch.distributed.init_process_group(comm_backend, rank=rank, world_size=world)
        self.registry, self.trainer = build_inner("training_backend", backend, TrainerConfig, config_json, model_json,
                                                  seed)

    def forward_backward(self, request: bytes, ctx: dict[str, int]) -> dict[str, float]:
        from arctic_core.losses.objective import build_objective

        req = wire.decode(request, FwdBwdRequest)
        objective = build_objective(self.registry, req.loss, req.temperature)
        return self.trainer.forward_backward(req.batch, objective, LossContext(**ctx), req.scale)

    def log_probs(self, request: bytes) -> bytes:
        return run_log_probs(self.trainer, self.registry, request)

    def weights(self) -> bytes:
        """All ranks call this (a gather under ZeRO-3); the driver keeps rank 0's."""
        return weights_blob(self.trainer.named_weights())

    def load_weights(self, blob: bytes) -> None:
        self.trainer.load_weights(named_tensors(blob))

    def weights_to_send(self) -> NamedTensors:
        return self.trainer.named_weights()

    def gather_weights(self) -> None:
        """A rank other than the sender joins the sender's ZeRO-3 parameter gathers."""
        for _ in self.trainer.named_weights():
            pass

    def ready(self) -> bool:
        return True

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.trainer, method)(*args, **kwargs)


class RayDataParallelTrainer:
    options_model = RayTrainerOptions

    def __init__(self, config: TrainerConfig, model: ModelConfig, *, seed: int) -> None:
        self.options = validate_options(self.options_model, config, "ray")
        inner = self.options.inner(config, "trainer")
        opts = self.options
        ray = ensure_ray(opts.address, num_cpus=max(os.cpu_count() or 1, opts.workers))
        require_resources(ray, "the ray trainer", opts.workers, opts.cpus_per_worker, opts.gpus_per_worker)
        self._spawn_args = (inner.model_dump_json(), model.model_dump_json(), seed)
        self.workers: list[Any] = []
        self.dead_ranks: list[int] = []
        self._spawn()

    def _spawn(self) -> None:
        """Start every rank afresh (a new process group: survivors of a dead rank cannot rejoin)."""
        import ray

        for worker in self.workers:
            ray.kill(worker)
        actor = ray.remote(num_cpus=self.options.cpus_per_worker, num_gpus=self.options.gpus_per_worker)(TrainerWorker)
        port = free_port()
        self.workers = [actor.remote(rank, self.options.workers, port, self.options.resolved_comm_backend,
                                     self.options.backend, *self._spawn_args)
                        for rank in range(self.options.workers)]
        self.dead_ranks = []
        self._gather([w.ready.remote() for w in self.workers], "start")  # surfaces construction errors

    # ---- training ----------------------------------------------------------------------------

    def forward_backward(self, batch: RolloutBatch, objective: Objective, ctx: LossContext,
                         scale: float = 1.0) -> dict[str, float]:
        spec = getattr(objective, "spec", None)
        if spec is None:
            raise RequestError("the ray backend needs an objective built by build_objective (it rebuilds it per rank)")
        terms, temperature = spec
        world = len(self.workers)
        shards = split_by_groups(batch, world)
        # A rank with no prompt group of its own runs the first group with its loss times zero:
        # it adds no gradient but joins every collective (ZeRO-3's gathers, the step's reduction,
        # which DeepSpeed cannot run on a rank that saw no backward). Its metrics are dropped.
        idle = [rows is None for rows in shards]
        requests = [wire.encode(FwdBwdRequest(
            batch=batch.select(batch.groups()[int(batch.prompt_index[0])] if rows is None else rows), loss=terms,
            temperature=temperature, scale=0.0 if rows is None else scale * world,
            max_response_len=ctx.max_response_len)) for rows in shards]
        context = {"num_tokens": ctx.num_tokens, "num_sequences": ctx.num_sequences,
                   "max_response_len": ctx.max_response_len}
        results = self._gather([w.forward_backward.remote(r, context) for w, r in zip(self.workers, requests,
                                                                                          strict=True)], "fwd_bwd")
        return _sum_metrics([metrics for metrics, skip in zip(results, idle, strict=True) if not skip])

    def discard_gradients(self) -> None:
        self._on_all("discard_gradients")

    def optimizer_step(self, lr: float | None = None) -> dict[str, float]:
        return self._on_all("optimizer_step", lr=lr)[0]

    def log_probs(self, batch: RolloutBatch, processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]:
        # Rank 0 holds whole parameters below ZeRO-3 and answers alone; under ZeRO-3 every rank must
        # join the parameter gathers, so all run the batch and rank 0's answer is kept.
        request = log_probs_request(batch, processors)
        targets = self.workers if self._zero3 else self.workers[:1]
        return dict(named_tensors(self._gather([w.log_probs.remote(request) for w in targets], "log_probs")[0]))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from named_tensors(self._gather([w.weights.remote() for w in self.workers], "named_weights")[0])

    def weight_group_members(self) -> list[Any]:
        return self.workers[:1]

    def start_weight_send(self, method: str, *args: Any) -> list[Any]:
        others = [w.gather_weights.remote() for w in self.workers[1:]] if self._zero3 else []
        return [getattr(self.workers[0], method).remote(*args), *others]

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Rank 0's view of the accumulated gradients (before the step's reduction: its shard's)."""
        return self._gather([self.workers[0].call.remote("full_gradients")], "full_gradients")[0]

    def load_weights(self, weights: NamedTensors) -> None:
        blob = weights_blob(weights)
        self._gather([w.load_weights.remote(blob) for w in self.workers], "load_weights")

    def save_checkpoint(self, path: Path) -> None:
        self._on_all("save_checkpoint", path)

    def load_checkpoint(self, path: Path) -> None:
        """Restore every rank; after a worker died this restarts all of them first (the server's
        ``load_checkpoint`` is how a client recovers from a dead rank)."""
        if self.dead_ranks:
            self._spawn()
        self._on_all("load_checkpoint", path)

    def export_hf(self, path: Path) -> None:
        self._on_all("export_hf", path)

    def sleep(self) -> None:
        self._on_all("sleep")

    def wake(self) -> None:
        self._on_all("wake")

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []

    def health(self) -> dict[str, Any]:
        """For ``/health``; never waits on a worker (deaths are those calls have observed)."""
        return {"workers": len(self.workers), "dead_ranks": list(self.dead_ranks)}

    # ---- plumbing ----------------------------------------------------------------------------

    @property
    def _zero3(self) -> bool:
        """Parameters are sharded: every forward is a collective that all ranks must join."""
        return self.options.options.get("zero_stage") == 3

    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._gather([w.call.remote(method, *args, **kwargs) for w in self.workers], method)

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        """Every rank's answer. A dead rank is named first: its peers then fail in their collectives
        too, and those errors are only the echo."""
        import ray

        results, dead, failed = [], [], []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                dead.append(rank)
            except ray.exceptions.RayTaskError as exc:
                failed.append(task_error(exc, f"training worker rank {rank}", what))
        if dead:
            self.dead_ranks = sorted(set(self.dead_ranks) | set(dead))
            raise WorkerError(f"training worker rank {dead[0]} died during {what}; load_checkpoint restarts the "
                              "workers from a checkpoint")
        if failed:
            raise failed[0]
        return results


def ray_trainer_config(trainer: TrainerConfig, workers: int, address: str | None = None) -> TrainerConfig:
    """``trainer`` run as ``workers`` data-parallel Ray ranks (``arctic-rl serve --ray``)."""
    if trainer.backend == "ray":
        options = {**trainer.options, "workers": workers, **({"address": address} if address else {})}
        return trainer.model_copy(update={"options": options})
    options = {"workers": workers, "backend": trainer.backend, "options": trainer.options, "address": address}
    return trainer.model_copy(update={"backend": "ray", "options": options})


def split_by_groups(batch: RolloutBatch, ranks: int) -> list[list[int] | None]:
    """Response rows per rank: whole prompt groups, the largest first onto the lightest rank
    (tokens: the prompt once plus its responses). A rank with nothing gets None."""
    loads = [0] * ranks
    rows: list[list[int]] = [[] for _ in range(ranks)]
    groups = batch.groups()
    cost = [int(batch.prompt_lens[p]) + int(batch.response_lens[g].sum()) if g else 0 for p, g in enumerate(groups)]
    for p in sorted(range(len(groups)), key=lambda p: -cost[p]):
        if groups[p]:
            rank = loads.index(min(loads))
            rows[rank] += groups[p]
            loads[rank] += cost[p]
    return [sorted(r) if r else None for r in rows]


def _sum_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Per-rank metrics are parts over the global loss context (the world-size scale touches only
    the backward), so the whole batch's are their sums (extremes: the extreme of the ranks')."""
    total: dict[str, float] = {}
    for metrics in results:
        add_metrics(total, metrics)
    return total
