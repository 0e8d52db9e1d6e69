"""``trainer.compile_elementwise``: the decoder layers' RMSNorms, SiLU x up and rotary embedding as
fused kernels.

In training, transformers' RMSNorm runs about six elementwise kernels forward (upcast, square,
mean, rsqrt, multiply, downcast and the weight) and more backward, SiLU x up three; with gradient
checkpointing the forward ones run twice. They are a large share of a GRPO micro-batch's GPU time
(docs/design/zorro.md). ``torch.compile`` turns each into one kernel
forward and one or two backward, from the same expressions as transformers' (the casts where
transformers casts), so the result is the same math; only the order of the fp32 sums differs.

The rotary embedding (``apply_rotary_pos_emb``: about ten kernels forward for q and k, more
backward) runs as one kernel each way: a Triton kernel on a GPU in half precision
(:mod:`arctic_zorro.rotary_kernel`), the compiled expression elsewhere. In bf16 its two products
and their sum round once instead of after each operation (within one bf16 step of the eager
values, and closer to fp32's). The attention modules keep transformers' own ``forward`` code, run
with that function in ``apply_rotary_pos_emb``'s place.

These functions are compiled once per process (dynamic shapes: any token count, the hidden and the
head norms' widths) and every matching module's ``forward`` calls them, so no module is compiled
on its own; hooks on the modules (ZeRO-3's weight gathers) run as before.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from arctic_core.compiling import compiled
from arctic_core.errors import ConfigError

log = logging.getLogger(__name__)

FAMILIES = ("qwen3", "qwen2", "llama", "mistral")


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of these families, expression for expression."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` of these families, expression for expression."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def token_major_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary` on q/k that transformers hands over as ``[B, H, T, D]`` views of the
    token-major ``[B, T, H, D]`` tensors the projections write; the results are such views too.

    On a GPU in half precision the Triton kernel runs; elsewhere the compiled expression, on the
    token-major tensors. A compiled function's backward expects its output gradients in the layout
    it traced: compiled on the ``[B, H, T, D]`` views, every gradient coming back token-major was
    first copied through a strided kernel (four copies per layer and micro-batch on the GPU)."""
    if unsqueeze_dim != 1:
        return rotary(query, key, cos, sin, unsqueeze_dim)
    if query.is_cuda:
        from arctic_zorro import rotary_kernel  # Triton (with torch on Linux): imported where a GPU runs it

        if rotary_kernel.fits(query, key, cos, sin):
            return rotary_kernel.TritonRotary.apply(query, key, cos, sin)
    query, key = compiled(_rotary_on_tokens)(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    return query.transpose(1, 2), key.transpose(1, 2)


def _rotary_on_tokens(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary(query, key, cos, sin, unsqueeze_dim=2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@functools.cache
def _attention_forward(attention_class: type) -> Callable[..., object]:
    """``attention_class.forward`` (inside transformers' decorators, which only rename keyword
    arguments the trainer does not pass) with :func:`token_major_rotary` as its ``apply_rotary_pos_emb``."""
    forward = inspect.unwrap(attention_class.forward)
    names = {**forward.__globals__, "apply_rotary_pos_emb": token_major_rotary}
    patched = types.FunctionType(forward.__code__, names, forward.__name__, forward.__defaults__, forward.__closure__)
    patched.__kwdefaults__ = forward.__kwdefaults__
    return patched


def _norm_forward(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return compiled(rms_norm)(hidden, module.weight, module.variance_epsilon)


def _mlp_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(compiled(silu_and_mul)(module.gate_proj(x), module.up_proj(x)))


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why ``model``'s layers cannot use the compiled functions (None: they can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"compile_elementwise supports {', '.join(FAMILIES)} models, not {config.model_type!r}"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "compile_elementwise needs SiLU MLPs without biases"
    return None


def apply_compile_elementwise(model: PreTrainedModel, setting: bool | Literal["auto"]) -> list[torch.nn.Module]:
    """The ``trainer.compile_elementwise`` setting: True compiles (refusing models it does not cover),
    "auto" compiles where it pays and applies (a CUDA model of a covered family), False never."""
    if setting == "auto":
        reason = "the model is not on a CUDA device" if model.device.type != "cuda" else unsupported_reason(model)
        if reason is not None:
            log.info("compile_elementwise auto: off (%s)", reason)
            return []
    return compile_elementwise(model) if setting else []


def compile_elementwise(model: PreTrainedModel) -> list[torch.nn.Module]:
    """Point ``model``'s RMSNorms, MLPs and attention modules at the compiled functions; the modules
    that now use them (``del module.forward`` gives one back its own)."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ConfigError(reason)
    fused = []
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = functools.partial(_norm_forward, module)
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")):
            module.forward = functools.partial(_mlp_forward, module)
        elif "apply_rotary_pos_emb" in inspect.unwrap(type(module).forward).__code__.co_names:
            module.forward = types.MethodType(_attention_forward(type(module)), module)
        else:
            continue
        fused.append(module)
    return fused
