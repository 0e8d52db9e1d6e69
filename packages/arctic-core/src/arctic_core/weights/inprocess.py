"""The built-in in-process weight transport: copy the trainer's tensors into each receiver."""

from __future__ import annotations

import time

from arctic_core.config import NoOptions, WeightSyncConfig
from arctic_core.plugins.interfaces import TrainingBackend, WeightReceiver


class InProcessWeightSync:
    """Hands the trainer's named tensors to receivers living in the same process (no copies on the wire)."""

    options_model = NoOptions

    def __init__(self, config: WeightSyncConfig | None = None) -> None:
        self.config = config or WeightSyncConfig()
        self.config.checked_options(self.options_model)

    def sync(self, source: TrainingBackend, receivers: list[WeightReceiver], version: int) -> dict[str, float]:
        start = time.perf_counter()
        weights = list(source.named_weights())
        for receiver in receivers:
            receiver.update_weights(weights, version)
        num_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        return {"seconds": time.perf_counter() - start, "bytes": float(num_bytes), "receivers": float(len(receivers))}
