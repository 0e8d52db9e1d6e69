"""The actor side of weight syncs between Ray actors (``torch-broadcast`` and ``cuda-ipc``).

:class:`WeightSyncActor` is mixed into the Ray backends' actors: the trainer's workers
(:mod:`arctic_core.ray.trainer`; rank 0 sends) and the sampler replicas
(:mod:`arctic_core.ray.sampler`; they receive). An actor says what it sends
(``weights_to_send``) or where what it receives goes (``receive_weights_into``); the transports
call the other methods remotely.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from arctic_core.plugins.interfaces import NamedTensors
from arctic_core.weights.broadcast import (
    BroadcastError,
    WeightGroup,
    broadcast_weights,
    plan_broadcast,
    receive_broadcast,
    share_plan,
)


class WeightSyncActor:
    _weight_group: WeightGroup | None = None
    _weight_store: Any = None
    _ipc_buffers: list[torch.Tensor] | None = None

    # ---- what the actor provides ---------------------------------------------------------------

    def weights_to_send(self) -> NamedTensors:
        raise NotImplementedError(f"{type(self).__name__} does not send weights")

    def receive_weights_into(self, weights: NamedTensors, version: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not receive weights")

    # ---- torch-broadcast -----------------------------------------------------------------------

    def open_weight_group(self, world: int) -> tuple[str, int]:
        """As rank 0: serve the group's TCP store on a free port of this node; returns its address."""
        import ray

        host = ray.util.get_node_ip_address()
        self._weight_store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=300))
        return host, self._weight_store.port

    def join_weight_group(self, host: str, port: int, rank: int, world: int, backend: str) -> None:
        if rank == 0:
            self._weight_group = WeightGroup(self._weight_store, rank, world, backend)
        else:
            self._weight_group = WeightGroup.join(host, port, rank, world, backend)

    def send_weights(self, version: int, bucket_bytes: int) -> int:
        weights = list(self.weights_to_send())
        plan = plan_broadcast(weights, bucket_bytes, version)
        share_plan(self._group(), plan)
        return broadcast_weights(self._group(), weights, plan)

    def receive_weights(self) -> int:
        plan = share_plan(self._group())
        self.receive_weights_into(list(receive_broadcast(self._group(), plan)), plan["version"])
        return int(plan["version"])

    def _group(self) -> WeightGroup:
        if self._weight_group is None:
            raise BroadcastError("this actor has not joined a weight group (join_weight_group)")
        return self._weight_group

    # ---- cuda-ipc ------------------------------------------------------------------------------

    def export_weights_ipc(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        from arctic_core.weights.ipc import export_cuda_ipc

        payload, self._ipc_buffers = export_cuda_ipc(self.weights_to_send(), bucket_bytes, version)
        return payload

    def import_weights_ipc(self, payload: dict[str, Any]) -> int:
        from arctic_core.weights.ipc import import_cuda_ipc

        version = int(payload["plan"]["version"])
        self.receive_weights_into(import_cuda_ipc(payload), version)
        torch.cuda.current_stream().synchronize()  # copied before the sender frees its buffers
        return version

    def release_weights_ipc(self) -> None:
        self._ipc_buffers = None
        torch.cuda.ipc_collect()
