"""The Ray transport: the server is a named Ray actor; clients anywhere in the cluster call it.

For frameworks that already run on Ray (verl, SkyRL): ``ArcticClient.ray(config)`` starts the
server actor (its engines may be Ray actors themselves, e.g. the ``ray`` training backend), and
``ArcticClient.ray(name=...)`` from any other process of the cluster connects to it. Requests and
results cross as wire-format bytes (safetensors + JSON), exactly as over HTTP: Ray only moves the
bytes, no Python object of ours is pickled. Errors come back as JSON and are raised as the same
:mod:`arctic_core.errors` classes as in process.

The actor is an async actor: its calls run side by side as the server allows (generate calls
together in the sampler's batch, training calls one at a time, lifecycle calls alone; see
``arctic_core.serving.server``), up to ``server.max_generate_calls`` generate calls and a few more.
``acall`` awaits the call's ObjectRef, so one event loop keeps many in flight.
A server actor that dies answers every later call with a :class:`WorkerError` that says so.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arctic_core import wire
from arctic_core.config import ArcticConfig
from arctic_core.errors import WorkerError, error_answer, remote_error
from arctic_core.protocol import Empty, Message, Result
from arctic_core.ray.actors import ensure_ray

log = logging.getLogger(__name__)
DEFAULT_NAME = "arctic-server"


class ServerActor:
    """The Arctic server inside a Ray actor: wire bytes in, wire bytes (or a JSON error) out."""

    def __init__(self, config_json: str) -> None:
        from arctic_core.serving.server import ArcticServer

        self.server = ArcticServer(ArcticConfig.model_validate_json(config_json))

    async def call(self, op: str, body: bytes) -> bytes | dict[str, Any]:
        try:
            request = await asyncio.to_thread(wire.decode_request, op, body)
            return await asyncio.to_thread(wire.encode, await self.server.ahandle(op, request))
        except Exception as exc:  # bad input, or an engine failure: answer it, keep serving
            status, error, message = error_answer(op, exc)
            if status == 500:
                log.exception("operation %r failed", op)
            return {"status": status, "error": error, "message": message}


class RayTransport:
    """Calls the server actor ``actor``; ``owns_server`` when this transport started it."""

    def __init__(self, actor: Any, name: str, owns_server: bool) -> None:
        self.actor, self.name, self.owns_server = actor, name, owns_server

    @classmethod
    def start(cls, config: ArcticConfig, name: str = DEFAULT_NAME, address: str | None = None,
              num_gpus: float = 0.0, num_cpus: float = 1.0) -> RayTransport:
        """Start the server actor ``name`` (in the cluster at ``address``, or a local one). Ray gives
        it ``num_cpus`` compute threads (its OMP_NUM_THREADS)."""
        ray = ensure_ray(address)
        cluster = ray.cluster_resources()
        for resource, wanted in (("GPU", num_gpus), ("CPU", num_cpus)):
            if wanted > cluster.get(resource, 0.0):  # Ray would wait for it forever
                raise WorkerError(f"the Arctic server actor asks for {wanted:g} {resource}(s) and this Ray cluster "
                                  f"has {cluster.get(resource, 0.0):g}")
        # Enough concurrency for every generate call the server takes: the next one is answered busy.
        options = {"name": name, "num_gpus": num_gpus, "num_cpus": num_cpus,
                   "max_concurrency": config.server.max_generate_calls + 16}
        actor = ray.remote(ServerActor).options(**options).remote(config.model_dump_json())
        transport = cls(actor, name, owns_server=True)
        transport.call("status", Empty())  # wait until the engines are built; raise if they fail
        return transport

    @classmethod
    def connect(cls, name: str = DEFAULT_NAME, address: str | None = None) -> RayTransport:
        """Connect to the running server actor ``name``."""
        ray = ensure_ray(address)
        try:
            actor = ray.get_actor(name)
        except ValueError:
            raise WorkerError(f"no Arctic server actor named {name!r} in this Ray cluster") from None
        return cls(actor, name, owns_server=False)

    def call(self, op: str, request: Message) -> Result:
        import ray

        ref = self.actor.call.remote(op, wire.encode_request(op, request))
        try:
            return self._result(op, ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            raise self._dead(op, exc) from None

    async def acall(self, op: str, request: Message) -> Result:
        import ray

        ref = self.actor.call.remote(op, wire.encode_request(op, request))
        try:
            return self._result(op, await ref)
        except ray.exceptions.RayActorError as exc:
            raise self._dead(op, exc) from None

    def _result(self, op: str, answer: bytes | dict[str, Any]) -> Result:
        if isinstance(answer, dict):
            raise remote_error(answer["status"], answer["error"], answer["message"])
        return wire.decode_result(op, answer)

    def _dead(self, op: str, exc: Exception) -> WorkerError:
        return WorkerError(f"the Arctic server actor {self.name!r} died or is unreachable ({op}): {exc}")

    def close(self) -> None:
        """The owner's close ends the actor (after ``shutdown``, if the client ran it); a
        connected client leaves the server to its owner."""
        if self.owns_server:
            import ray

            ray.kill(self.actor)
