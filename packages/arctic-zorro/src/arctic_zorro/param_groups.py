"""The optimizer's parameter groups: which parameters weight decay applies to."""

from __future__ import annotations

from typing import Any

import torch

from arctic_core.config import OptimizerConfig

# Hugging Face Trainer's rule (``Trainer.get_decay_parameter_names``): no decay inside LayerNorm
# modules, nor for parameters whose names say bias or norm.
TRANSFORMERS_NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


Named = list[tuple[str, torch.nn.Parameter]]


def param_groups(model: torch.nn.Module, config: OptimizerConfig) -> list[dict[str, Any]]:
    """``model``'s trainable parameters as AdamW groups, each with its weight decay."""
    return [{"params": [p for _, p in named], "weight_decay": decay} for named, decay in _named_groups(model, config)]


def param_group_shapes(model: torch.nn.Module, config: OptimizerConfig) -> list[list[list[Any]]]:
    """Each group's ``[name, full shape]`` pairs in order: how the optimizer's state is laid out
    (it is saved by position, so it only loads into the same groups)."""
    return [[[name, list(getattr(p, "ds_shape", p.shape))] for name, p in named]  # ZeRO-3: p is a shard
            for named, _ in _named_groups(model, config)]


def _named_groups(model: torch.nn.Module, config: OptimizerConfig) -> list[tuple[Named, float]]:
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if config.decay == "all" or config.weight_decay == 0.0:
        return [(trainable, config.weight_decay)]
    from transformers.trainer_pt_utils import get_parameter_names

    decayed = set(get_parameter_names(model, [torch.nn.LayerNorm], TRANSFORMERS_NO_DECAY))
    groups = [([(n, p) for n, p in trainable if n in decayed], config.weight_decay),
              ([(n, p) for n, p in trainable if n not in decayed], 0.0)]
    return [g for g in groups if g[0]]
