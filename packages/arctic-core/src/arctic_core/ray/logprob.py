"""The ``ray`` log-prob backend: any log-prob backend (e.g. the frozen reference model) in a Ray
actor of its own, placed on its own device or colocated (fractional ``gpus``) with the others.

``reference: {backend: ray, options: {backend: deepspeed, gpus: 0.5}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field

from arctic_core.batch import RolloutBatch
from arctic_core.config import LogProbConfig, ModelConfig, validate_options
from arctic_core.plugins.interfaces import NamedTensors, Processor
from arctic_core.ray.actors import (InnerBackendOptions, build_inner, ensure_ray, get_one, log_probs_request,
                                    named_tensors, require_resources, run_log_probs, weights_blob)


class RayLogProbOptions(InnerBackendOptions):
    backend: str = Field("deepspeed", description="The log-prob backend the actor runs.")
    gpus: float = Field(0.0, ge=0, description="1 for a GPU of its own; a fraction to colocate.")
    cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for the actor (its compute threads).")


class LogProbWorker:
    """The inner log-prob backend in its own process."""

    def __init__(self, backend: str, config_json: str, model_json: str, seed: int) -> None:
        self.registry, self.engine = build_inner("logprob_backend", backend, LogProbConfig, config_json, model_json,
                                                 seed)

    def log_probs(self, request: bytes) -> bytes:
        return run_log_probs(self.engine, self.registry, request)

    def load_weights(self, blob: bytes) -> None:
        self.engine.load_weights(named_tensors(blob))

    def call(self, method: str) -> None:
        getattr(self.engine, method)()


class RayLogProbEngine:
    options_model = RayLogProbOptions

    def __init__(self, config: LogProbConfig, model: ModelConfig, *, seed: int) -> None:
        self.options = validate_options(self.options_model, config, "ray")
        inner = self.options.inner(config, "log-prob backend")
        ray = ensure_ray(self.options.address)
        require_resources(ray, "the ray log-prob backend", 1, self.options.cpus, self.options.gpus)
        actor = ray.remote(num_cpus=self.options.cpus, num_gpus=self.options.gpus)(LogProbWorker)
        self.worker = actor.remote(self.options.backend, inner.model_dump_json(), model.model_dump_json(), seed)
        self.asleep = False

    def log_probs(self, batch: RolloutBatch, processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]:
        blob = self._get(self.worker.log_probs.remote(log_probs_request(batch, processors)), "log_probs")
        return dict(named_tensors(blob))

    def load_weights(self, weights: NamedTensors) -> None:
        self._get(self.worker.load_weights.remote(weights_blob(weights)), "load_weights")

    def sleep(self) -> None:
        self._get(self.worker.call.remote("sleep"), "sleep")
        self.asleep = True

    def wake(self) -> None:
        self._get(self.worker.call.remote("wake"), "wake")
        self.asleep = False

    def shutdown(self) -> None:
        import ray

        ray.kill(self.worker)

    def _get(self, ref: Any, what: str) -> Any:
        return get_one(ref, "the log-prob engine actor", what)
