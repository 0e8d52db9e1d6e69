"""The ``embedded`` sampling backend: the embedded engine behind the sampling hookspec."""

from __future__ import annotations

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.config import ModelConfig, SamplerConfig, SamplingParams, validate_options
from arctic_core.hf import load_causal_lm
from arctic_core.plugins.interfaces import NamedTensors
from arctic_fca.engine import EmbeddedEngine, EngineOptions, GenerationOutput, GenerationRequest

class EmbeddedSampler:
    """Continuous batching + prefix sharing + FCA decode; options are :class:`EngineOptions`."""

    options_model = EngineOptions

    def __init__(self, config: SamplerConfig, model: ModelConfig, *, seed: int) -> None:
        config = config.model_copy(update={"options": {"max_num_seqs": config.max_batch_size, **config.options}})
        options = validate_options(self.options_model, config, "embedded")
        self.engine = EmbeddedEngine(load_causal_lm(model), options, seed=seed)

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        return as_batch(prompts, self.engine.generate(prompts, params))

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> PendingRollout:
        """The request joins the engine's running batch at its next step (the server's generate calls
        run side by side through this)."""
        return PendingRollout(self.engine, self.engine.submit(prompts, params))

    def load(self) -> dict[str, int]:
        return self.engine.load()

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        self.engine.update_weights(weights, version)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def shutdown(self) -> None:
        self.engine.close()
        self.engine.sleep()


class PendingRollout:
    """A request in the engine's batch, answered as a :class:`RolloutBatch`."""

    def __init__(self, engine: EmbeddedEngine, request: GenerationRequest) -> None:
        self.engine, self.request = engine, request

    def wait(self, timeout: float | None = None) -> RolloutBatch:
        return as_batch(self.request.prompts, self.request.wait(timeout))

    def cancel(self) -> None:
        self.engine.cancel(self.request)


def as_batch(prompts: list[list[int]], outputs: list[GenerationOutput]) -> RolloutBatch:
    """The engine's samples as a batch, with the policy version of each token."""
    return RolloutBatch.from_samples(prompts, [o.tokens for o in outputs], [o.prompt_index for o in outputs],
                                     [o.logprobs for o in outputs], [o.policy_version for o in outputs],
                                     [o.token_versions for o in outputs])
