"""The core's own plugin: built-in losses, processors and the in-process weight transport.

Registered through the ``arctic`` entry point like any third-party plugin.
"""

from __future__ import annotations

from arctic_core import processors
from arctic_core.hookspecs import hookimpl
from arctic_core.losses import policy, regularizers
from arctic_core.registry import Lazy
from arctic_core.weight_files import SafetensorsFilesTransport
from arctic_core.weight_sync import InProcessTransport


@hookimpl
def arctic_losses():
    return {
        "ppo": policy.PPOLoss,
        "gspo": policy.GSPOLoss,
        "kl": regularizers.KLLoss,
        "entropy": regularizers.EntropyBonus,
        "sft": regularizers.SFTLoss,
    }


@hookimpl
def arctic_processors():
    return {"logprobs": processors.LogProbs, "entropy": processors.Entropy}


@hookimpl
def arctic_training_backends():
    return {"ray": Lazy("arctic_core.ray_trainer:RayDataParallelTrainer",
                        "Data parallel over Ray actors: one rank of an inner training backend per worker.")}


@hookimpl
def arctic_weight_transports():
    return {"inprocess": InProcessTransport, "safetensors-files": SafetensorsFilesTransport}
