"""arctic-zorro's plugin: registers its training and log-prob backends through the ``arctic`` entry point."""

from __future__ import annotations

from arctic_core import Lazy, hookimpl


@hookimpl
def arctic_training_backends():
    return {
        "torch": Lazy("arctic_zorro.torch_backend:TorchTrainer",
                      "Plain transformers model + torch AdamW (exact baseline).",
                      options="arctic_zorro.torch_backend:TorchOptions"),
        "deepspeed": Lazy("arctic_zorro.deepspeed_engine:DeepSpeedTrainer",
                          "DeepSpeed engine, ZeRO stage 0-3 (options.zero_stage), torch AdamW.",
                          options="arctic_zorro.deepspeed_options:DeepSpeedTrainerOptions"),
        # arctic-zorro 0.1's name for the torch backend, kept working with a DeprecationWarning.
        "reference": Lazy("arctic_zorro.torch_backend:TorchTrainer", "The torch backend's old name.",
                          options="arctic_zorro.torch_backend:TorchOptions", renamed_to="torch"),
    }


@hookimpl
def arctic_logprob_backends():
    return {
        "torch": Lazy("arctic_zorro.torch_backend:TorchLogProbEngine",
                      "Forward-only transformers model (e.g. the frozen KL reference).",
                      options="arctic_zorro.torch_backend:TorchOptions"),
        "deepspeed": Lazy("arctic_zorro.deepspeed_engine:DeepSpeedLogProbEngine",
                          "Forward-only DeepSpeed engine (ZeRO-3 partitions the weights).",
                          options="arctic_zorro.deepspeed_options:DeepSpeedLogProbOptions"),
        "reference": Lazy("arctic_zorro.torch_backend:TorchLogProbEngine", "The torch backend's old name.",
                          options="arctic_zorro.torch_backend:TorchOptions", renamed_to="torch"),
    }
