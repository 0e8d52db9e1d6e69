"""The optimizer's parameter groups: which parameters weight decay applies to."""

from __future__ import annotations

from typing import Any

import torch

from arctic_core.config import OptimizerConfig

# Hugging Face Trainer's rule (``Trainer.get_decay_parameter_names``): no decay inside LayerNorm
# modules, nor for parameters whose names say bias or norm.
TRANSFORMERS_NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def param_groups(model: torch.nn.Module, config: OptimizerConfig) -> list[dict[str, Any]]:
    """``model``'s trainable parameters as AdamW groups, each with its weight decay."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if config.decay == "all" or config.weight_decay == 0.0:
        return [{"params": [p for _, p in trainable], "weight_decay": config.weight_decay}]
    from transformers.trainer_pt_utils import get_parameter_names

    decayed = set(get_parameter_names(model, [torch.nn.LayerNorm], TRANSFORMERS_NO_DECAY))
    groups = [{"params": [p for n, p in trainable if n in decayed], "weight_decay": config.weight_decay},
              {"params": [p for n, p in trainable if n not in decayed], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
