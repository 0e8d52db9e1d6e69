"""Mixed into vLLM's GPU worker (``worker_extension_cls``): loads the weights the Arctic trainer
sends, through the model's own ``load_weights`` (Hugging Face names; vLLM fuses q/k/v and
gate/up itself), and hands FCA's metadata builders the host's block tables. Reached from
:class:`arctic_fca.vllm.sampler.VllmSampler` by ``collective_rpc``; the CUDA-IPC receive is
:class:`arctic_core.weights.actor.WeightSyncActor`'s ``import_weights_ipc``, the same one the Ray
sampler replicas run.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from arctic_core.plugins.interfaces import NamedTensors
from arctic_core.weights.actor import WeightSyncActor


class ArcticWorkerExtension(WeightSyncActor):
    model_runner: Any  # the worker's, once vLLM has mixed this class in

    def receive_weights_into(self, weights: NamedTensors, version: int) -> None:
        self.model_runner.model.load_weights(weights=weights)

    def arctic_load_tensors(self, named: dict[str, torch.Tensor]) -> None:
        """Weights sent as (CPU) tensors."""
        self.model_runner.model.load_weights(weights=list(named.items()))

    def arctic_weights_checksum(self) -> float:
        """The sum of every parameter in fp64: equal to the sender's when an update arrived whole
        (vLLM's fused q/k/v and gate/up hold the same numbers)."""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model_runner.model.parameters()))

    def arctic_fca_attach_host_tables(self) -> int:
        """FCA's builders learn from the host's block tables which batches share nothing
        (``arctic_fca.vllm.host_tables``); the number of builders attached."""
        from arctic_fca.vllm.host_tables import attach_host_tables

        return attach_host_tables(self.model_runner)

    def arctic_fca_stats(self) -> dict[str, int]:
        """How this worker's batches went since it started, summed over FCA's builders: ``decode``,
        ``mixed`` (split between FCA and the base) and ``base`` batches; ``forest``, ``reuse`` and
        ``plain`` work builds (``DeviceWorkBuilder.builds``)."""
        from arctic_fca.vllm.fca import fca_builders

        totals: Counter[str] = Counter()
        for _, builder in fca_builders(self.model_runner):
            totals.update(builder.steps)
            totals.update(builder.work_builder.builds if builder.work_builder else {})
        return dict(totals)
