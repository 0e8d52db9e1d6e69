"""Device memory a training forward may plan for: what is free now, less a reserve.

``checkpoint_layers: auto`` plans each micro-batch's kept layers against it, and the LM head keeps
its chunks' logits for the backward only where they fit in it.
"""

from __future__ import annotations

import torch

RESERVE_FRACTION = 0.1
"""Device memory never planned for activations: allocator fragmentation, ZeRO-3 gathers, kernels' scratch."""
HEAD_BYTES_PER_LOGIT = 12
"""fp32 logits, their softmax and their gradient, per token and vocabulary entry of one head chunk."""


def activation_budget(device: torch.device) -> int | None:
    """Bytes free for activations on ``device`` now (None off CUDA: no budget to plan against)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached - int(RESERVE_FRACTION * total)
