"""What the Ray backends share: starting Ray, the bytes that cross between actors (wire-format
requests, safetensors weights and outputs), and turning an actor's failure into an Arctic error.

The backends themselves: :mod:`arctic_core.ray.trainer` (data-parallel ranks),
:mod:`arctic_core.ray.sampler` (sampler replicas), :mod:`arctic_core.ray.logprob` (a log-prob engine).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from pydantic import Field

from arctic_core import wire
from arctic_core.batch import RolloutBatch
from arctic_core.config import ModelConfig, StrictModel
from arctic_core.errors import ArcticError, ConfigError, RemoteError, RequestError, WorkerError
from arctic_core.plugins.interfaces import NamedTensors, Processor
from arctic_core.losses.objective import ProcessorSet
from arctic_core.protocol import LogProbsRequest


class InnerBackendOptions(StrictModel):
    """What every Ray backend's options share: the backend its actors run, and the cluster."""

    backend: str = Field(description="The backend every actor runs.")
    options: dict[str, Any] = Field(default_factory=dict, description="That backend's options.")
    address: str | None = Field(None, description="Ray cluster to join; None starts a local one.")

    def inner(self, config: Any, what: str) -> Any:
        """``config`` (the Ray backend's own) turned into the inner backend's."""
        if self.backend == "ray":
            raise ConfigError(f"the ray {what} cannot run itself in its actors; name the inner backend")
        return config.model_copy(update={"backend": self.backend, "options": self.options})


def build_inner(kind: str, backend: str, config_cls: type[StrictModel], config_json: str, model_json: str,
                seed: int) -> tuple[Any, Any]:
    """In an actor: ``(registry, engine)``, the inner backend built from its JSON configs."""
    from arctic_core.plugins.registry import default_registry

    registry = default_registry()
    factory = registry.get(kind, backend)
    engine = factory(config_cls.model_validate_json(config_json), ModelConfig.model_validate_json(model_json),
                     seed=seed)
    return registry, engine


_local_cluster = False  # whether this process started its Ray cluster (rather than joining one)


def ensure_ray(address: str | None, num_cpus: int | None = None) -> Any:
    """Ray, initialised once per process: joins ``address`` or starts a local cluster."""
    ray_environment()
    import ray

    global _local_cluster
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({"num_cpus": num_cpus} if num_cpus and not address else {}))
        _local_cluster = address is None
    return ray


def require_resources(ray: Any, who: str, actors: int, cpus: float, gpus: float,
                      settle_s: float = 15.0) -> None:
    """Refuse ``actors`` actors of ``cpus``/``gpus`` each that Ray could not place: it would queue
    them silently, and the server would wait forever. A cluster this process started only frees
    what this process holds, so what is available counts (after ``settle_s`` for actors just killed
    to hand theirs back); a cluster it joined (a framework's, a remote one) may free resources or
    add nodes later, so there only its total does."""
    joined = not _local_cluster
    deadline = time.monotonic() + (0.0 if joined else settle_s)
    while True:
        have = ray.cluster_resources() if joined else ray.available_resources()
        short = [(name, each, have.get(name, 0.0)) for name, each in (("GPU", gpus), ("CPU", cpus))
                 if actors * each > have.get(name, 0.0) + 1e-9]
        if not short or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if short:
        name, each, free = short[0]
        held = "in the Ray cluster" if joined else "free in the local Ray cluster"
        raise ConfigError(f"{who}: {actors} actor(s) x {each:g} {name} need {actors * each:g} {name}s, "
                          f"{free:g} {held}; lower its {name.lower()}s per actor or give Ray more")


def ray_environment() -> None:
    """Workers run this interpreter and this checkout as they are: Ray's ``uv run`` integration
    would otherwise upload the whole working directory (virtual environment included) to each.
    Its switch is read when Ray is imported, so set it and, if Ray is loaded already, its constant."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray._private.ray_constants as constants

    constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] not in ("0", "false")


def weights_blob(weights: NamedTensors) -> bytes:
    """Named tensors as safetensors bytes. Cloned: tied weights (embeddings / LM head) share
    memory, which safetensors refuses."""
    return save_safetensors({name: t.detach().cpu().clone() for name, t in weights})


def named_tensors(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    return list(load_safetensors(blob).items())


def log_probs_request(batch: RolloutBatch, processors: Mapping[str, Processor]) -> bytes:
    """A log-prob call for another process: the processors travel by name and temperature."""
    if not isinstance(processors, ProcessorSet):
        raise RequestError("a Ray engine needs processors built by build_processors (each actor rebuilds them)")
    return wire.encode(LogProbsRequest(batch=batch, processors=processors.names, temperature=processors.temperature))


def run_log_probs(engine: Any, registry: Any, request: bytes) -> bytes:
    """The actor's side of :func:`log_probs_request`: outputs as safetensors bytes."""
    from arctic_core.losses.objective import build_processors

    req = wire.decode(request, LogProbsRequest)
    outputs = engine.log_probs(req.batch, build_processors(registry, req.processors, req.temperature))
    return save_safetensors({k: v.contiguous() for k, v in outputs.items()})


def get_one(ref: Any, who: str, what: str) -> Any:
    """``ray.get`` of one actor call; a failure is raised as :func:`task_error` says, a death as a
    :class:`WorkerError` that names ``who``."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        raise WorkerError(f"{who} died during {what}: {exc}") from None
    except ray.exceptions.RayTaskError as exc:
        raise task_error(exc, who, what) from None


def task_error(exc: Any, who: str, what: str) -> Exception:
    """A failed actor call (a ``RayTaskError``) as an Arctic error: Arctic errors (bad input, bad
    config) keep their class, the rest is a :class:`WorkerError` naming ``who``."""
    cause = getattr(exc, "cause", None)  # the exception the actor raised
    if isinstance(cause, ArcticError) and not isinstance(cause, RemoteError):
        return type(cause)(f"{who}: {cause}")
    return WorkerError(f"{who} failed during {what}: {cause if cause is not None else exc}")


def get_all(refs: list[Any], who: str, what: str) -> list[Any]:
    return [get_one(ref, who, what) for ref in refs]
