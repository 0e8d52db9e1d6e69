"""Weight sync by CUDA IPC, for engines that share one GPU from different processes (colocated
Ray actors, or a Ray trainer beside the server's own sampler): no copy through the host, no
collective. The sender packs its weights into one flat device buffer per bucket of the same plan
as the broadcast (:func:`~arctic_core.weights.broadcast.plan_broadcast`), exports a CUDA IPC
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

from arctic_core.config import NoOptions, WeightSyncConfig
from arctic_core.errors import ConfigError
from arctic_core.plugins.interfaces import NamedTensors, TrainingBackend, WeightReceiver
from arctic_core.weights.broadcast import WHO, pack_bucket, parse_dtype, plan_broadcast, require_actors, unpack_buckets


def export_cuda_ipc(weights: NamedTensors, bucket_bytes: int,
                    version: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``(payload, buffers)``: the plan and one IPC handle per bucket; keep ``buffers`` alive until
    the receivers are done."""
    named = list(weights)
    if not named or not named[0][1].is_cuda:
        raise ConfigError("weight_sync 'cuda-ipc' needs the trainer's weights on a CUDA device; use "
                          "'torch-broadcast' (gloo) or 'inprocess' for CPU engines")
    plan = plan_broadcast(named, bucket_bytes, version)
    tensors = dict(named)
    buffers = [pack_bucket(tensors, bucket, named[0][1].device) for bucket in plan["buckets"]]
    torch.cuda.current_stream().synchronize()  # the buffers are complete before anyone maps them
    payload = {"plan": plan, "handles": [portable_handle(flat) for flat in buffers],
               "bytes": sum(flat.numel() * flat.element_size() for flat in buffers)}
    return payload, buffers


def import_cuda_ipc(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of an exported payload, as views of the sender's mapped buffers (valid
    until the sender releases them: copy before returning control)."""
    return unpack_buckets(payload["plan"], [open_handle(handle) for handle in payload["handles"]])


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

    options_model = NoOptions

    def __init__(self, config: WeightSyncConfig | None = None) -> None:
        self.config = config or WeightSyncConfig()
        self.config.checked_options(self.options_model)

    def sync(self, source: TrainingBackend, receivers: list[WeightReceiver], version: int) -> dict[str, float]:
        from arctic_core.ray.actors import get_all, get_one

        start = time.perf_counter()
        require_actors("cuda-ipc", [source])
        payload = get_all(source.start_weight_send("export_weights_ipc", version, self.config.bucket_bytes), WHO,
                          "cuda-ipc export")[0]
        try:
            for receiver in receivers:
                if callable(getattr(receiver, "weight_group_members", None)):
                    get_all(receiver.start_weight_receive(version, "import_weights_ipc", payload), WHO,
                            "cuda-ipc import")
                else:  # an engine of this process on the same GPU
                    receiver.update_weights(import_cuda_ipc(payload), version)
                    torch.cuda.current_stream().synchronize()
        finally:
            get_one(source.weight_group_members()[0].release_weights_ipc.remote(), WHO, "cuda-ipc release")
        return {"seconds": time.perf_counter() - start, "bytes": float(payload["bytes"]),
                "receivers": float(len(receivers))}
