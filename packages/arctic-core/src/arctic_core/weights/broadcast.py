"""Weight sync by ``torch.distributed`` broadcast: the trainer's rank 0 broadcasts its weights to
sampler processes (gloo on the CPU, NCCL on GPUs), in a process group of its own.

A :class:`WeightGroup` is a standalone process group (its own TCP store), so it spans processes that
already belong to other groups (the trainer's data-parallel ranks) or to none (samplers). Tensors
travel as flat buckets of one dtype each (at most ``bucket_bytes``, a larger tensor gets a bucket of
its own), so one collective moves many small tensors. Both sides follow the same plan: names,
shapes, dtypes and bucket boundaries, as JSON (:func:`plan_broadcast`), which the sender shares over
the group itself (:func:`share_plan`, a uint8 broadcast: no pickle)::

    # trainer, rank 0                                  # sampler, any other rank
    plan = plan_broadcast(weights, bucket_bytes, v)
    share_plan(group, plan)                            plan = share_plan(group)
    broadcast_weights(group, weights, plan)            received = receive_broadcast(group, plan)
                                                       sampler.update_weights(received, plan["version"])

:class:`TorchBroadcastTransport` (``weight_sync: {transport: torch-broadcast}``) runs that between
Ray actors: engines that live in actors (the ``ray`` trainer and sampler backends) expose the
:class:`~arctic_core.plugins.interfaces.BroadcastSource` / ``BroadcastReceiver`` methods, and their actors
mix in :class:`~arctic_core.weights.actor.WeightSyncActor`.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from arctic_core.config import StrictModel, WeightSyncConfig
from arctic_core.errors import ArcticError, ConfigError
from arctic_core.plugins.interfaces import TrainingBackend, WeightReceiver
from arctic_core.weights.files import split_aliases

NamedList = Sequence[tuple[str, torch.Tensor]]


class BroadcastError(ArcticError, RuntimeError):
    """The two sides of a broadcast disagree (plan, names or shapes)."""


class WeightGroup:
    """A standalone process group: rank 0 sends, every other rank receives."""

    def __init__(self, store: dist.Store, rank: int, world: int, backend: str, timeout_s: float = 600.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.group: Any = dist.ProcessGroupNCCL(store, rank, world)
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, world, timeout)
            self.device = torch.device("cpu")  # gloo moves CPU tensors
        else:
            raise ConfigError(f"weight broadcast backend must be 'nccl' or 'gloo', got {backend!r}")
        self.store, self.rank, self.world = store, rank, world

    @classmethod
    def join(cls, host: str, port: int, rank: int, world: int, backend: str) -> WeightGroup:
        """Join the group whose TCP store rank 0 serves at ``host:port`` (rank 0 starts it)."""
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
        return cls(store, rank, world, backend)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Leave in order: once every rank is done communicating, the others let go of the group
        first and rank 0, whose process serves the TCP store, last. (Torn down in an arbitrary
        order at interpreter exit, a gloo group can abort its process.)"""
        self.group.barrier(dist.BarrierOptions()).wait()
        self.group = None
        left = [f"arctic-weight-group-left-{r}" for r in range(1, self.world)]
        if self.rank == 0:
            self.store.wait(left)
        else:
            self.store.set(left[self.rank - 1], "1")
        self.store = None


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BroadcastError(f"unknown dtype {name!r} in broadcast plan")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_broadcast(weights: NamedList, bucket_bytes: int, version: int) -> dict:
    """The JSON plan both sides follow: buckets of one dtype, in a fixed order, plus tied aliases."""
    aliases: dict[str, str] = {}
    by_dtype: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, item in split_aliases(weights):
        if isinstance(item, str):
            aliases[name] = item  # tied weights travel once
        else:
            by_dtype.setdefault(_dtype_name(item.dtype), []).append((name, item))
    buckets = []
    for dtype, tensors in by_dtype.items():
        buckets += _pack(dtype, tensors, bucket_bytes)
    return {"version": version, "buckets": buckets, "aliases": aliases}


def _pack(dtype: str, tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[dict]:
    buckets: list[dict] = []
    current: list = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append({"dtype": dtype, "tensors": current})
            current, size = [], 0
        current.append([name, list(tensor.shape)])
        size += nbytes
    if current:
        buckets.append({"dtype": dtype, "tensors": current})
    return buckets


def share_plan(group: WeightGroup, plan: dict | None = None, src: int = 0) -> dict:
    """Broadcasts the plan as JSON bytes (no pickle): ``src`` passes it, every other rank gets it back."""
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    if plan is not None:
        payload = torch.frombuffer(bytearray(json.dumps(plan).encode()), dtype=torch.uint8).to(group.device)
        length[0] = payload.numel()
    group.broadcast(length, src)
    if plan is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(payload, src)
    return plan if plan is not None else json.loads(bytes(payload.cpu().tolist()).decode())


def broadcast_weights(group: WeightGroup, weights: NamedList, plan: dict, src: int = 0) -> int:
    """Sender side: broadcasts every bucket of ``plan`` from ``src``; returns the bytes sent."""
    named = dict(weights)
    sent = 0
    for bucket in plan["buckets"]:
        flat = pack_bucket(named, bucket, group.device)
        group.broadcast(flat, src)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_broadcast(group: WeightGroup, plan: dict, src: int = 0,
                      device: str | torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: takes part in every bucket's broadcast; yields ``(name, tensor)`` per the plan.

    Every bucket is received before this returns: collectives must run in the same order on all
    ranks, so they cannot wait on how fast the caller consumes the iterator.
    """
    flats = []
    for bucket in plan["buckets"]:
        numel = sum(torch.Size(shape).numel() for _, shape in bucket["tensors"])
        flat = torch.empty(numel, dtype=parse_dtype(bucket["dtype"]), device=group.device)
        group.broadcast(flat, src)
        flats.append(flat.to(device) if device is not None else flat)
    return iter(unpack_buckets(plan, flats))


def pack_bucket(named: dict[str, torch.Tensor], bucket: dict, device: torch.device) -> torch.Tensor:
    """One bucket of a plan as a flat tensor of its dtype on ``device``."""
    dtype = parse_dtype(bucket["dtype"])
    try:
        parts = [named[name].detach().reshape(-1).to(device, dtype) for name, _ in bucket["tensors"]]
    except KeyError as exc:
        raise BroadcastError(f"the plan names weight {exc.args[0]!r}, which the sender does not have") from None
    return torch.cat(parts)


def unpack_buckets(plan: dict, flats: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` per the plan, as views of the buckets' flat tensors (aliases included)."""
    received: dict[str, torch.Tensor] = {}
    for bucket, flat in zip(plan["buckets"], flats, strict=True):
        shapes = [torch.Size(shape) for _, shape in bucket["tensors"]]
        parts = flat.split([s.numel() for s in shapes])
        for (name, _), shape, part in zip(bucket["tensors"], shapes, parts, strict=True):
            received[name] = part.view(shape)
    for alias, target in plan["aliases"].items():
        received[alias] = received[target]
    return list(received.items())


# --------------------------------------------------------------------------- between Ray actors
class BroadcastOptions(StrictModel):
    backend: Literal["gloo", "nccl"] = "gloo"
    """The process group's backend: nccl between GPU engines, gloo between CPU ones."""


class TorchBroadcastTransport:
    """``torch-broadcast``: rank 0 of a Ray-actor trainer broadcasts to Ray-actor sampler replicas.

    The group (the sender plus every receiver actor) is formed on the first sync and again whenever
    its members change (e.g. workers restarted from a checkpoint). ``options.backend``: ``nccl``
    (GPU engines) or ``gloo`` (CPU engines; the default)."""

    options_model = BroadcastOptions

    def __init__(self, config: WeightSyncConfig | None = None) -> None:
        self.config = config or WeightSyncConfig()
        self.backend = self.config.checked_options(self.options_model).backend
        self._members: list[Any] = []

    def sync(self, source: TrainingBackend, receivers: list[WeightReceiver], version: int) -> dict[str, float]:
        from arctic_core.ray.actors import get_all, get_one

        start = time.perf_counter()
        require_actors("torch-broadcast", [source, *receivers])
        members = source.weight_group_members()[:1] + [m for r in receivers for m in r.weight_group_members()]
        if members != self._members:
            host, port = get_one(members[0].open_weight_group.remote(len(members)), WHO, "opening the weight group")
            get_all([m.join_weight_group.remote(host, port, rank, len(members), self.backend)
                     for rank, m in enumerate(members)], WHO, "joining the weight group")
            self._members = members
        refs = source.start_weight_send("send_weights", version, self.config.bucket_bytes)
        refs += [ref for r in receivers for ref in r.start_weight_receive(version, "receive_weights")]
        sent = get_all(refs, WHO, "torch-broadcast")[0]
        return {"seconds": time.perf_counter() - start, "bytes": float(sent), "receivers": float(len(members) - 1)}


WHO = "a weight-sync actor"


def require_actors(transport: str, engines: list[Any]) -> None:
    """Refuse clearly when an engine does not live in Ray actors (it cannot join an actor sync)."""
    missing = [type(e).__name__ for e in engines if not callable(getattr(e, "weight_group_members", None))]
    if missing:
        raise ConfigError(f"weight_sync {transport!r} needs engines in Ray actors (the 'ray' trainer and sampler "
                          f"backends); {', '.join(missing)} cannot take part: use 'inprocess'")
