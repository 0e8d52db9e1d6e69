"""Mixed into vLLM's GPU worker (``worker_extension_cls``): loads the weights the Arctic trainer
sends, through the model's own ``load_weights`` (Hugging Face names; vLLM fuses q/k/v and
gate/up itself). Reached from :class:`arctic_fca.vllm_sampler.VllmSampler` by ``collective_rpc``.
"""

from __future__ import annotations

from typing import Any

import torch


class ArcticWeightLoader:
    model_runner: Any  # the worker's, once vLLM has mixed this class in

    def arctic_load_ipc(self, payload: dict[str, Any]) -> int:
        """Weights exported as CUDA IPC handles (the trainer shares this GPU)."""
        from arctic_core.weight_ipc import import_cuda_ipc

        self.model_runner.model.load_weights(weights=import_cuda_ipc(payload))
        torch.cuda.current_stream().synchronize()  # copied before the sender frees its buffers
        return int(payload["plan"]["version"])

    def arctic_load_tensors(self, named: dict[str, torch.Tensor]) -> None:
        """Weights sent as (CPU) tensors."""
        self.model_runner.model.load_weights(weights=list(named.items()))

    def arctic_weights_checksum(self) -> float:
        """The sum of every parameter in fp64: equal to the sender's when an update arrived whole
        (vLLM's fused q/k/v and gate/up hold the same numbers)."""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model_runner.model.parameters()))
