"""The ``ray`` sampling backend: replicas of any sampling backend, one Ray actor each.

``sampler: {backend: ray, options: {replicas: 2, backend: embedded, gpus_per_replica: 1}}``. A
``generate`` call splits its prompts into contiguous chunks, one per replica, balanced by the
tokens they will hold (prompt + n x max_tokens), runs them side by side and joins the results in
prompt order. Weight updates reach every replica: through the object store as safetensors bytes
(``inprocess`` weight sync), or straight from the trainer's rank 0 by ``torch-broadcast`` (each
replica actor is a receiver of the weight group). Fractional ``gpus_per_replica`` with the ``ray``
trainer's ``gpus_per_worker`` colocates engines on one device; sleep/wake then keeps only one
engine's memory resident at a time.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from arctic_core import wire
from arctic_core.batch import RolloutBatch
from arctic_core.config import ModelConfig, SamplerConfig, SamplingParams, validate_options
from arctic_core.plugins.interfaces import NamedTensors
from arctic_core.protocol import GenerateRequest, GenerateResult
from arctic_core.ray.actors import (InnerBackendOptions, build_inner, ensure_ray, get_one, named_tensors,
                                    require_resources, weights_blob)
from arctic_core.weights.actor import WeightSyncActor


class RaySamplerOptions(InnerBackendOptions):
    replicas: int = Field(2, ge=1, description="Sampler replicas, one Ray actor each.")
    backend: str = Field("embedded", description="The sampling backend every replica runs.")
    gpus_per_replica: float = Field(0.0, ge=0, description="1 for a GPU each; fractions to colocate.")
    cpus_per_replica: float = Field(1.0, ge=0, description="CPUs Ray reserves per replica (its compute threads).")


class SamplerWorker(WeightSyncActor):
    """One replica (a Ray actor): the inner sampling backend in its own process."""

    def __init__(self, backend: str, config_json: str, model_json: str, seed: int) -> None:
        _, self.sampler = build_inner("sampling_backend", backend, SamplerConfig, config_json, model_json, seed)

    def generate(self, request: bytes) -> bytes:
        req = wire.decode(request, GenerateRequest)
        return wire.encode(GenerateResult(batch=self.sampler.generate(req.prompts, req.params)))

    def update_weights(self, blob: bytes, version: int) -> None:
        self.sampler.update_weights(named_tensors(blob), version)

    def receive_weights_into(self, weights: NamedTensors, version: int) -> None:
        self.sampler.update_weights(weights, version)

    def call(self, method: str) -> None:
        getattr(self.sampler, method)()


class RaySampler:
    options_model = RaySamplerOptions

    def __init__(self, config: SamplerConfig, model: ModelConfig, *, seed: int) -> None:
        self.options = validate_options(self.options_model, config, "ray")
        inner = self.options.inner(config, "sampler")
        ray = ensure_ray(self.options.address)
        require_resources(ray, "the ray sampler", self.options.replicas, self.options.cpus_per_replica,
                          self.options.gpus_per_replica)
        actor = ray.remote(num_cpus=self.options.cpus_per_replica,
                           num_gpus=self.options.gpus_per_replica)(SamplerWorker)
        # Seeds differ per replica: two replicas must not draw the same random stream.
        self.replicas = [actor.remote(self.options.backend, inner.model_dump_json(), model.model_dump_json(), seed + i)
                         for i in range(self.options.replicas)]
        self.policy_version = 0
        self.asleep = False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        chunks = split_prompts(prompts, len(self.replicas), params.n * params.max_tokens)
        refs = [replica.generate.remote(wire.encode(GenerateRequest(prompts=prompts[lo:hi], params=params)))
                for replica, (lo, hi) in zip(self.replicas, chunks, strict=True) if hi > lo]
        parts = [wire.decode(blob, GenerateResult).batch for blob in self._gather(refs, "generate")]
        return join_samples(prompts, parts)

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        import ray

        blob = ray.put(weights_blob(weights))  # one copy in the object store for every replica
        self._gather([r.update_weights.remote(blob, version) for r in self.replicas], "update_weights")
        self.policy_version = version

    def weight_group_members(self) -> list[Any]:
        return list(self.replicas)

    def start_weight_receive(self, version: int, method: str, *args: Any) -> list[Any]:
        self.policy_version = version  # the replicas read it from what they receive
        return [getattr(r, method).remote(*args) for r in self.replicas]

    def sleep(self) -> None:
        self._gather([r.call.remote("sleep") for r in self.replicas], "sleep")
        self.asleep = True

    def wake(self) -> None:
        self._gather([r.call.remote("wake") for r in self.replicas], "wake")
        self.asleep = False

    def shutdown(self) -> None:
        import ray

        for replica in self.replicas:
            ray.kill(replica)
        self.replicas = []

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        return [get_one(ref, "a sampler replica", what) for ref in refs]


def ray_sampler_config(sampler: SamplerConfig, replicas: int, address: str | None = None) -> SamplerConfig:
    """``sampler`` run as ``replicas`` Ray actors (``arctic-rl serve --ray``)."""
    if sampler.backend == "ray":
        options = {**sampler.options, "replicas": replicas, **({"address": address} if address else {})}
        return sampler.model_copy(update={"options": options})
    options = {"replicas": replicas, "backend": sampler.backend, "options": sampler.options, "address": address}
    return sampler.model_copy(update={"backend": "ray", "options": options})


def split_prompts(prompts: list[list[int]], replicas: int, new_tokens: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` prompt ranges, one per replica, of about equal token load
    (each prompt once plus its samples' new tokens). Ranges may be empty."""
    loads = [len(p) + new_tokens for p in prompts]
    total, bounds, running, replica = sum(loads), [0], 0, 1
    for i, load in enumerate(loads):
        running += load
        while replica < replicas and running >= total * replica / replicas:
            bounds.append(i + 1)
            replica += 1
    bounds += [len(prompts)] * (replicas + 1 - len(bounds))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def join_samples(prompts: list[list[int]], parts: list[RolloutBatch]) -> RolloutBatch:
    """The replicas' batches (contiguous prompt ranges, in order) as one batch over ``prompts``."""
    responses, index, logprobs, versions, offset = [], [], [], [], 0
    for part in parts:
        for row in range(part.num_responses):
            length = int(part.response_lens[row])
            responses.append(part.response(row))
            index.append(offset + int(part.prompt_index[row]))
            logprobs.append(part.sampling_logprobs[row, :length].tolist())
            versions.append(int(part.policy_version[row]))
        offset += part.num_prompts
    return RolloutBatch.from_samples(prompts, responses, index, logprobs, versions)
