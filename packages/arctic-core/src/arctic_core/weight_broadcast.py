"""Weight sync by ``torch.distributed`` broadcast: the trainer (``src``) broadcasts its weights to
sampler processes in the same process group (gloo on the CPU, NCCL on GPUs).

Tensors travel as flat buckets of one dtype each (at most ``bucket_bytes``, a larger tensor gets a
bucket of its own), so one collective moves many small tensors. Both sides need the same plan:
names, shapes, dtypes and bucket boundaries. The plan is JSON (:func:`plan_broadcast`); it reaches
receivers through :func:`share_plan` (a uint8 broadcast over the same group) or any control channel.

The sender and the receiver are separate functions, called by separate processes::

    # trainer, rank src                               # sampler, any other rank
    plan = plan_broadcast(weights, bucket_bytes, v)
    share_plan(group, plan)                            plan = share_plan(group)
    broadcast_weights(group, weights, plan)            sampler.update_weights(receive_broadcast(group, plan), plan["version"])
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from arctic_core.errors import ArcticError
from arctic_core.weight_files import split_aliases

NamedList = Sequence[tuple[str, torch.Tensor]]


class BroadcastError(ArcticError, RuntimeError):
    """The two sides of a broadcast disagree (plan, names or shapes)."""


def _dtype(name: str) -> torch.dtype:
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


def _device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL moves CUDA tensors only, gloo (here) CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_plan(group: dist.ProcessGroup | None, plan: dict | None = None, src: int = 0) -> dict:
    """Broadcasts the plan as JSON bytes (no pickle): ``src`` passes it, every other rank gets it back."""
    device = _device(group)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    if plan is not None:
        payload = torch.frombuffer(bytearray(json.dumps(plan).encode()), dtype=torch.uint8).to(device)
        length[0] = payload.numel()
    dist.broadcast(length, src, group=group)
    if plan is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src, group=group)
    return plan if plan is not None else json.loads(bytes(payload.cpu().tolist()).decode())


def broadcast_weights(group: dist.ProcessGroup | None, weights: NamedList, plan: dict, src: int = 0) -> int:
    """Sender side: broadcasts every bucket of ``plan`` from ``src``; returns the bytes sent."""
    named = dict(weights)
    device = _device(group)
    sent = 0
    for bucket in plan["buckets"]:
        try:
            parts = [named[name].detach().reshape(-1).to(device, _dtype(bucket["dtype"])) for name, _ in bucket["tensors"]]
        except KeyError as exc:
            raise BroadcastError(f"the plan names weight {exc.args[0]!r}, which the sender does not have") from None
        flat = torch.cat(parts)
        dist.broadcast(flat, src, group=group)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_broadcast(group: dist.ProcessGroup | None, plan: dict, src: int = 0,
                      device: str | torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: takes part in every bucket's broadcast; yields ``(name, tensor)`` per the plan.

    Every bucket is received before this returns: collectives must run in the same order on all
    ranks, so they cannot wait on how fast the caller consumes the iterator.
    """
    wire = _device(group)
    received: dict[str, torch.Tensor] = {}
    for bucket in plan["buckets"]:
        shapes = [torch.Size(shape) for _, shape in bucket["tensors"]]
        flat = torch.empty(sum(s.numel() for s in shapes), dtype=_dtype(bucket["dtype"]), device=wire)
        dist.broadcast(flat, src, group=group)
        flat = flat.to(device) if device is not None else flat
        for (name, _), shape, part in zip(bucket["tensors"], shapes, flat.split([s.numel() for s in shapes])):
            received[name] = part.view(shape)
    for alias, target in plan["aliases"].items():
        received[alias] = received[target]
    return iter(list(received.items()))
