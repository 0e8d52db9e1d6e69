"""Reaching the Arctic backend from every process of a verl run.

verl's trainer runs in one Ray actor and its rollout (agent loops) in others, so the trainer and
the rollout client each connect on their own: to a server Ray actor by name, or to an
``arctic-rl serve`` URL, through the backend's
:class:`~arctic_core.adapters.backend.BackendAddress`, sent to the agent-loop workers inside the
rollout client.
"""

from __future__ import annotations

import uuid

from omegaconf import DictConfig

from arctic_core.adapters import backend
from arctic_core.adapters.backend import BackendAddress
from arctic_core.client import ArcticClient
from arctic_core.config import ArcticConfig
from arctic_verl.mapping import arctic_config
from arctic_verl.settings import ArcticSettings


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

    def start_actor(server_config: ArcticConfig) -> tuple[ArcticClient, BackendAddress]:
        name = f"arctic-verl-{uuid.uuid4().hex[:8]}"
        client = ArcticClient.ray(server_config, name=name, num_gpus=server_gpus(settings), num_cpus=settings.num_cpus)
        return client, BackendAddress(actor=name)

    return backend.open_backend(settings, lambda: arctic_config(config, settings, on_gpu=server_gpus(settings) > 0),
                                start_actor)
