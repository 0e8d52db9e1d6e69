"""Weight sync by CUDA IPC, for engines that share one GPU from different processes (colocated
Ray actors, or a Ray trainer beside the server's own sampler): no copy through the host, no
collective. The sender packs its weights into one flat device buffer per bucket of the same plan
as the broadcast (:func:`~arctic_core.weight_broadcast.plan_broadcast`), exports a CUDA IPC
handle per buffer, and keeps the buffers alive until every receiver has copied from them.

``weight_sync: {transport: cuda-ipc}``. A handle is plain data (ints, bytes, names: :func:`portable_handle`),
so it travels through Ray or any msgpack/JSON channel between processes of this machine (it is
meaningless elsewhere); receivers map each buffer, copy the named views into their weights and
drop the mapping.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from arctic_core.config import WeightSyncConfig
from arctic_core.errors import ConfigError
from arctic_core.interfaces import NamedTensors, TrainingBackend, WeightReceiver
from arctic_core.weight_broadcast import WHO, parse_dtype, plan_broadcast, require_actors


def export_cuda_ipc(weights: NamedTensors, bucket_bytes: int, version: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``(payload, buffers)``: the plan and one IPC handle per bucket; keep ``buffers`` alive until
    the receivers are done."""
    named = list(weights)
    if not named or not named[0][1].is_cuda:
        raise ConfigError("weight_sync 'cuda-ipc' needs the trainer's weights on a CUDA device; use "
                          "'torch-broadcast' (gloo) or 'inprocess' for CPU engines")
    plan = plan_broadcast(named, bucket_bytes, version)
    tensors = dict(named)
    buffers, handles = [], []
    for bucket in plan["buckets"]:
        dtype = parse_dtype(bucket["dtype"])
        flat = torch.cat([tensors[name].detach().reshape(-1).to(dtype) for name, _ in bucket["tensors"]])
        buffers.append(flat)
        handles.append(portable_handle(flat))
    torch.cuda.current_stream().synchronize()  # the buffers are complete before anyone maps them
    return {"plan": plan, "handles": handles}, buffers


def import_cuda_ipc(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of an exported payload, as views of the sender's mapped buffers (valid
    until the sender releases them: copy before returning control)."""
    received: dict[str, torch.Tensor] = {}
    for bucket, handle in zip(payload["plan"]["buckets"], payload["handles"], strict=True):
        flat = open_handle(handle)
        shapes = [torch.Size(shape) for _, shape in bucket["tensors"]]
        for (name, _), shape, part in zip(bucket["tensors"], shapes, flat.split([s.numel() for s in shapes]), strict=True):
            received[name] = part.view(shape)
    for alias, target in payload["plan"]["aliases"].items():
        received[alias] = received[target]
    return list(received.items())


_HANDLE_FIELDS = ("size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "storage_bytes",
                  "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
                  "event_sync_required")


def portable_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """``tensor``'s CUDA IPC handle as plain data: torch's own reduction, with its classes and
    dtype replaced by their names."""
    rebuild, args = reduce_tensor(tensor)
    if rebuild is not rebuild_cuda_tensor:
        raise ConfigError(f"cuda-ipc exports CUDA tensors only, got one on {tensor.device}")
    out = dict(zip(_HANDLE_FIELDS, args[1:], strict=True))
    cls = out["storage_cls"]
    out.update(size=list(out["size"]), stride=list(out["stride"]), dtype=str(out["dtype"]).removeprefix("torch."),
               storage_cls=f"{cls.__module__}.{cls.__qualname__}")
    return out


def open_handle(handle: dict[str, Any]) -> torch.Tensor:
    """The tensor behind a :func:`portable_handle`, mapped into this process."""
    module, _, name = handle["storage_cls"].rpartition(".")
    if not module.startswith("torch"):
        raise ConfigError(f"cuda-ipc handle names storage class {handle['storage_cls']!r}, not a torch one")
    fields = {**handle, "size": torch.Size(handle["size"]), "stride": tuple(handle["stride"]),
              "dtype": parse_dtype(handle["dtype"]), "storage_cls": getattr(importlib.import_module(module), name)}
    return rebuild_cuda_tensor(torch.Tensor, *(fields[f] for f in _HANDLE_FIELDS))


class CudaIpcTransport:
    """``cuda-ipc``: the Ray trainer's rank 0 exports handles; Ray sampler replicas (or the
    server's own sampler, when it shares the GPU) copy from them."""

    def __init__(self, config: WeightSyncConfig | None = None) -> None:
        self.config = config or WeightSyncConfig()

    def sync(self, source: TrainingBackend, receivers: list[WeightReceiver], version: int) -> dict[str, float]:
        from arctic_core.ray_actors import get_all, get_one

        start = time.perf_counter()
        require_actors("cuda-ipc", [source])
        payload = get_all(source.start_weight_send("export_weights_ipc", version, self.config.bucket_bytes), WHO,
                          "cuda-ipc export")[0]
        try:
            for receiver in receivers:
                if callable(getattr(receiver, "weight_group_members", None)):
                    get_all(receiver.start_weight_receive(version, "import_weights_ipc", payload), WHO, "cuda-ipc import")
                else:  # an engine of this process on the same GPU
                    receiver.update_weights(import_cuda_ipc(payload), version)
                    torch.cuda.current_stream().synchronize()
        finally:
            get_one(source.weight_group_members()[0].release_weights_ipc.remote(), WHO, "cuda-ipc release")
        sent = sum(_bucket_bytes(b) for b in payload["plan"]["buckets"])
        return {"seconds": time.perf_counter() - start, "bytes": float(sent), "receivers": float(len(receivers))}


def _bucket_bytes(bucket: dict[str, Any]) -> int:
    size = torch.tensor([], dtype=parse_dtype(bucket["dtype"])).element_size()
    return size * sum(torch.Size(shape).numel() for _, shape in bucket["tensors"])
