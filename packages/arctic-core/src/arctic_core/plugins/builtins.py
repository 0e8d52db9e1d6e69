"""The core's own plugin: built-in losses, processors, the Ray backends and the weight transports.

Registered through the ``arctic`` entry point like any third-party plugin.
"""

from __future__ import annotations

from arctic_core.losses import processors
from arctic_core.plugins.hookspecs import hookimpl
from arctic_core.losses import policy, regularizers
from arctic_core.plugins.registry import Lazy
from arctic_core.weights.files import SafetensorsFilesTransport
from arctic_core.weights.inprocess import InProcessWeightSync


@hookimpl
def arctic_losses():
    return {
        "ppo": policy.PPOLoss,
        "gspo": policy.GSPOLoss,
        "cispo": policy.CISPOLoss,
        "sapo": policy.SAPOLoss,
        "vespo": policy.VESPOLoss,
        "dppo": policy.DPPOLoss,
        "pg": policy.PolicyGradientLoss,
        "kl": regularizers.KLLoss,
        "entropy": regularizers.EntropyBonus,
        "sft": regularizers.SFTLoss,
    }


@hookimpl
def arctic_processors():
    return {"logprobs": processors.LogProbs, "entropy": processors.Entropy}


@hookimpl
def arctic_training_backends():
    return {"ray": Lazy("arctic_core.ray.trainer:RayDataParallelTrainer",
                        "Data parallel over Ray actors: one rank of an inner training backend per worker.",
                        options="arctic_core.ray.trainer:RayTrainerOptions", needs="arctic-core[ray]")}


@hookimpl
def arctic_logprob_backends():
    return {"ray": Lazy("arctic_core.ray.logprob:RayLogProbEngine",
                        "An inner log-prob backend in a Ray actor of its own.",
                        options="arctic_core.ray.logprob:RayLogProbOptions", needs="arctic-core[ray]")}


@hookimpl
def arctic_sampling_backends():
    return {"ray": Lazy("arctic_core.ray.sampler:RaySampler",
                        "Replicas of an inner sampling backend, one Ray actor each.",
                        options="arctic_core.ray.sampler:RaySamplerOptions", needs="arctic-core[ray]")}


@hookimpl
def arctic_weight_transports():
    return {"inprocess": InProcessWeightSync, "safetensors-files": SafetensorsFilesTransport,
            "torch-broadcast": Lazy("arctic_core.weights.broadcast:TorchBroadcastTransport",
                                    "Broadcast from the ray trainer's rank 0 to ray sampler replicas (gloo / NCCL).",
                                    options="arctic_core.weights.broadcast:BroadcastOptions"),
            "cuda-ipc": Lazy("arctic_core.weights.ipc:CudaIpcTransport",
                             "CUDA IPC handles from the ray trainer's rank 0 to engines on the same GPU.",
                             options="arctic_core.config:NoOptions")}
