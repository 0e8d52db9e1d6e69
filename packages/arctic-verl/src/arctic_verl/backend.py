"""Reaching the Arctic backend from every process of a verl run.

verl's trainer runs in one Ray actor and its rollout (agent loops) in others, so the trainer and
the rollout client each connect on their own: to a server Ray actor by name, or to an
``arctic-rl serve`` URL. :class:`BackendAddress` is that address, small and picklable, sent to
the agent-loop workers inside the rollout client.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from omegaconf import DictConfig

from arctic_core.client import ArcticClient, AsyncArcticClient
from arctic_verl.mapping import arctic_config
from arctic_verl.settings import ArcticSettings


@dataclass(frozen=True)
class BackendAddress:
    """A server Ray actor's name, or an HTTP URL with its token."""

    actor: str | None = None
    url: str | None = None
    token: str | None = None
    timeout: float = 600.0

    def client(self) -> ArcticClient:
        if self.url:
            return ArcticClient.http(self.url, token=self.token, timeout=self.timeout)
        return ArcticClient.ray(name=self.actor)

    def async_client(self) -> AsyncArcticClient:
        if self.url:
            return AsyncArcticClient.http(self.url, token=self.token, timeout=self.timeout)
        return AsyncArcticClient.ray(name=self.actor)


def server_gpus(settings: ArcticSettings) -> float:
    """GPUs for the server actor: ``arctic.num_gpus``, else one when verl's Ray cluster has any.

    (verl's ``trainer.device`` says cuda wherever torch was built with CUDA, GPU or not, so the
    cluster's resources decide.)"""
    if settings.num_gpus is not None:
        return settings.num_gpus
    import ray

    return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def open_backend(config: DictConfig, settings: ArcticSettings) -> tuple[ArcticClient, BackendAddress]:
    """The client the trainer uses and the address the rollout uses: the server named by the
    settings, or one started now as a Ray actor of this run (it ends with the run)."""
    if not settings.starts_backend:
        address = BackendAddress(actor=settings.actor, url=settings.url, token=settings.token, timeout=settings.timeout)
        client = address.client()
        client.status()  # reachable, and the token is right
        return client, address
    name, gpus = f"arctic-verl-{uuid.uuid4().hex[:8]}", server_gpus(settings)
    client = ArcticClient.ray(arctic_config(config, settings, on_gpu=gpus > 0), name=name, num_gpus=gpus,
                              num_cpus=settings.num_cpus)
    return client, BackendAddress(actor=name)
