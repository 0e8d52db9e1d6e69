"""The engine's own decoder for the Llama-shaped families (Qwen3, Qwen2, Llama, Mistral): the same
math as transformers' modules, a handful of kernels per layer instead of dozens.

Per layer: residual add + RMSNorm (one kernel), one fused QKV product, query/key norm + rotary +
KV-cache store (one kernel), paged attention, the output product, add + norm, one fused gate/up
product, SiLU x up (one kernel), the down product. Decode steps (at most ``fused_linear.MAX_ROWS``
rows, Triton kernels) fold the norms, residual adds and SiLU x up into the products themselves
(``fused_linear``): no norm or activation kernel runs between them. The rotary tables are
computed once by the model's own rotary module, so every RoPE variant it computes statically is
exact here.

The fused QKV and gate/up weights are single tensors, and the model's own ``q_proj/k_proj/v_proj``
and ``gate_proj/up_proj`` parameters are re-pointed at views of them: weight updates written into
the model (``copy_weights_``) land in the fused tensors, and no weight is held twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from arctic_fca.engine import fused_linear
from arctic_fca.engine.attention import StepMetadata, attend
from arctic_fca.engine.fused_ops import add_rms_norm, qk_rope_store, silu_and_mul
from arctic_fca.fca.decode import default_kernel

log = logging.getLogger(__name__)

FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
# RoPE variants whose cos/sin depend on the position alone (not on the sequence's length).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    scale: float
    o_proj: torch.nn.Linear
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.nn.Linear


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot run on this decoder (None: it can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    rope_type = getattr(model.base_model.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE:
        return f"RoPE type {rope_type!r} depends on the sequence length"
    return None


class FusedDecoder:
    def __init__(self, model: PreTrainedModel, max_len: int) -> None:
        self.model, self.max_len = model, max_len
        config = model.config
        self.heads = (config.num_attention_heads, config.num_key_value_heads,
                      getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.eps = config.rms_norm_eps
        self.layers: list[_Layer] = []
        # Rows up to which the products run with the small operations folded in (0: never), and
        # whether they launch as programmatic dependents (set by bind for the device).
        self.fused_product_rows, self.pdl = fused_linear.MAX_ROWS, False
        self.bind()

    @classmethod
    def of(cls, model: PreTrainedModel, max_len: int) -> FusedDecoder | None:
        reason = unsupported_reason(model)
        if reason is not None:
            log.info("embedded engine: transformers' modules run the model (%s)", reason)
            return None
        return cls(model, max_len)

    # ---- weights -----------------------------------------------------------------------------

    def bind(self) -> None:
        """Fuse the projection weights (the model's parameters become views of them) and compute the
        rotary tables; again after the model moved devices (sleep/wake)."""
        base = self.model.base_model
        device = base.embed_tokens.weight.device
        self.triton = default_kernel(device) == "triton"
        self.pdl = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
        self.layers = [self._bind_layer(layer) for layer in base.layers]
        positions = torch.arange(self.max_len, device=device)[None]
        cos, sin = base.rotary_emb(base.embed_tokens.weight[:1], positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    def release(self) -> None:
        self.layers, self.cos, self.sin = [], None, None

    def _bind_layer(self, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = attn.q_proj, attn.k_proj, attn.v_proj
        qkv = _fuse(*(p.weight for p in projections))
        qkv_bias = _fuse(*(p.bias for p in projections)) if attn.q_proj.bias is not None else None
        norms = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return _Layer(layer.input_layernorm.weight, qkv, qkv_bias,
                      *(n.weight if n is not None else None for n in norms),
                      attn.scaling, attn.o_proj, layer.post_attention_layernorm.weight,
                      _fuse(mlp.gate_proj.weight, mlp.up_proj.weight), mlp.down_proj)

    # ---- forward -----------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of the packed tokens ``input_ids [T]``."""
        if self.triton and input_ids.shape[0] <= self.fused_product_rows:
            return self._fused_products(input_ids, positions, meta)
        base, triton = self.model.base_model, self.triton
        hidden, residual = base.embed_tokens(input_ids), None
        for index, layer in enumerate(self.layers):
            x, residual = add_rms_norm(hidden, residual, layer.input_norm, self.eps, triton=triton)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qk_rope_store(qkv, self.heads, positions, self.cos, self.sin, layer.q_norm, layer.k_norm,
                                    self.eps, meta.cache, index, meta.slots, triton=triton)
            attended = attend(q, k, v, index, meta, layer.scale)
            x, residual = add_rms_norm(layer.o_proj(attended.flatten(1)), residual, layer.post_norm, self.eps,
                                       triton=triton)
            hidden = layer.down(silu_and_mul(F.linear(x, layer.gate_up), triton=triton))
        return add_rms_norm(hidden, residual, base.norm.weight, self.eps, triton=triton)[0]

    def _fused_products(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """The same layers for a few rows: ``hidden`` is the residual stream; the products that write
        it add their output in and prepare it for the norm of the product that reads it next."""
        base, eps, linear = self.model.base_model, self.eps, fused_linear.fused_linear
        pdl = self.pdl and fused_linear.dependent_launch_pays(input_ids.shape[0])
        hidden = base.embed_tokens(input_ids)
        normed = fused_linear.Normed.of(hidden, self.layers[0].input_norm, triton=True)
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [base.norm.weight]
        for index, (layer, next_norm) in enumerate(zip(self.layers, next_norms, strict=True)):
            qkv = linear(normed, layer.qkv, layer.qkv_bias, eps=eps, pdl=pdl)
            q, k, v = qk_rope_store(qkv, self.heads, positions, self.cos, self.sin, layer.q_norm, layer.k_norm, eps,
                                    meta.cache, index, meta.slots, triton=True, pdl=pdl)
            attended = attend(q, k, v, index, meta, layer.scale).flatten(1)
            hidden, normed = linear(attended, layer.o_proj.weight, layer.o_proj.bias, residual=hidden,
                                    next_norm=layer.post_norm, pdl=pdl)
            act = linear(normed, layer.gate_up, eps=eps, gated=True, pdl=pdl)
            hidden, normed = linear(act, layer.down.weight, residual=hidden, next_norm=next_norm, pdl=pdl)
        return normed.normalized(eps, triton=True)


@torch.no_grad()
def _fuse(*params: torch.nn.Parameter) -> torch.Tensor:
    """One tensor stacking ``params`` (weights or biases) along rows; each becomes a view of it."""
    fused = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[start : start + rows]
        start += rows
    return fused
