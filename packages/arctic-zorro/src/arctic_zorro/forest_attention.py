"""Shared-KV attention over a packed prefix forest, plugged into transformers' attention registry.

Every token attends to the single packed copy of its ancestors' keys/values (no per-response
copies): key ``k`` is visible to query ``q`` iff ``k <= q <= subtree_end[k]`` (see
:mod:`arctic_zorro.forest`), intersected with a sliding window on position ids when a layer has one.

Two exact paths share that one rule:
- GPU, bf16/fp16: FlexAttention with a block mask built once per micro-batch (block-sparse: each
  response reads its prompt's blocks and its own, never its siblings');
- CPU and fp32: SDPA with a dense boolean mask (fine for test-sized batches).

The metadata is built once per micro-batch and reaches every layer through the model's
``**kwargs`` (``forest=...``), so no layer syncs with the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from arctic_zorro.forest import PackedForest

ATTENTION_NAME = "arctic_zorro_forest"
FLEX_BLOCK = 128


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Default dynamism: the first shape compiles static, later shapes compile once as dynamic,
    # so micro-batches of varying length do not recompile every call.
    return torch.compile(flex_attention)


@dataclass
class ForestAttentionMeta:
    """Per-micro-batch attention metadata shared by all layers (masks cached per sliding window)."""

    forest: PackedForest
    use_flex: bool
    _masks: dict[int | None, object] = field(default_factory=dict)

    @classmethod
    def build(cls, forest: PackedForest, dtype: torch.dtype) -> ForestAttentionMeta:
        # FlexAttention for half precision on the GPU (its kernels have no fp32 configs on every
        # head size); the dense-mask path is exact anywhere and serves fp32 and the CPU.
        use_flex = forest.input_ids.is_cuda and dtype in (torch.bfloat16, torch.float16)
        return cls(forest, use_flex=use_flex)

    def mask(self, window: int | None) -> object:
        if window not in self._masks:
            self._masks[window] = self._block_mask(window) if self.use_flex else self._dense_mask(window)
        return self._masks[window]

    def _dense_mask(self, window: int | None) -> torch.Tensor:
        mask = self.forest.dense_mask()
        if window is not None:
            pos = self.forest.position_ids
            mask &= (pos[:, None] - pos[None, :]) < window
        return mask

    def _block_mask(self, window: int | None) -> object:
        from torch.nn.attention.flex_attention import create_block_mask

        end, pos = self.forest.subtree_end, self.forest.position_ids

        def visible(b, h, q, k):
            allowed = (k <= q) & (q <= end[k])
            return allowed & ((pos[q] - pos[k]) < window) if window is not None else allowed

        size = self.forest.num_nodes
        return create_block_mask(visible, None, None, size, size, device=end.device, BLOCK_SIZE=FLEX_BLOCK, _compile=True)


def forest_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    forest: ForestAttentionMeta | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, Hkv, T, D]`` -> ``[1, T, H, D]``."""
    if forest is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs forest metadata; call it through arctic_zorro.packed_forward")
    for unsupported in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"forest attention cannot apply {unsupported!r} exactly; disable zorro for this model")
    if dropout:
        raise NotImplementedError("forest attention runs without attention dropout (RL training uses none)")
    mask = forest.mask(sliding_window)
    if forest.use_flex:
        out = _compiled_flex_attention()(query, key, value, block_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, forest_attention)
