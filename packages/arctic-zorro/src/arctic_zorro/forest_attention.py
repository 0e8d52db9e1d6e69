"""Shared-KV attention over a packed prefix forest, plugged into transformers' attention registry.

Every token attends to the single packed copy of its ancestors' keys/values (no per-response
copies): key ``k`` is visible to query ``q`` iff ``k <= q <= subtree_end[k]`` (see
:mod:`arctic_zorro.forest`), intersected with a sliding window on position ids when a layer has one.

Two exact paths share that one rule:
- GPU, bf16/fp16: FlexAttention with a block mask built once per micro-batch (block-sparse: each
  response reads its prompt's blocks and its own, never its siblings'), on q/k/v padded to one of
  a few lengths per octave so that its kernels compile for fixed shapes (see :class:`FlexKernels`);
- CPU and fp32: SDPA with a dense boolean mask (fine for test-sized batches).

The metadata is built once per micro-batch and reaches every layer through the model's
``**kwargs`` (``forest=...``), so no layer syncs with the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from arctic_core.compiling import bucketed_length
from arctic_zorro.forest import PackedForest

ATTENTION_NAME = "arctic_zorro_forest"
FLEX_BLOCK = 128
STATIC_LENGTHS = 6  # fixed-shape compiles per process: below Dynamo's limit of 8 per function


def padded_length(tokens: int) -> int:
    """``tokens`` rounded up to one of 8 lengths per octave (whole FlexAttention blocks).

    The padding costs little: padded queries see only themselves and no real query sees a padded
    key, so the block mask skips all but one block per padded query block; what remains is copying
    q/k/v into the longer tensors."""
    return bucketed_length(tokens, FLEX_BLOCK)


def _flex_fixed_shape(*args: object, **kwargs: object) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


def _flex_any_shape(*args: object, **kwargs: object) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


class FlexKernels:
    """``flex_attention`` compiled for the exact shape of each of the first ``static_lengths``
    (padded length, window, grad mode, dtype) it meets; later ones go to a second compile with
    torch.compile's default dynamism (any length from its second one on).

    Kernels compiled for any length made a training micro-batch slower (docs/design/zorro.md),
    and torch.compile's default switches to them at the second length it meets: packed
    micro-batches rarely repeat a length. Padded to a few lengths per octave
    (:func:`padded_length`), a run reuses a handful of fixed-shape kernels. The two wrappers are
    distinct functions so that their compile caches (and Dynamo's recompile limit, which counts
    per function) stay apart."""

    def __init__(self, static_lengths: int = STATIC_LENGTHS, kernel_options: dict | None = None) -> None:
        self.static_lengths = static_lengths
        self.fixed_shape = torch.compile(_flex_fixed_shape, dynamic=False)
        self.any_shape = torch.compile(_flex_any_shape)
        self.options = {} if kernel_options is None else {"kernel_options": kernel_options}
        self.fixed_keys: set[tuple[object, ...]] = set()

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: object, window: int | None,
                 scale: float | None) -> torch.Tensor:
        shape = (query.shape[-2], window, torch.is_grad_enabled(), query.dtype)
        if shape not in self.fixed_keys and len(self.fixed_keys) < self.static_lengths:
            self.fixed_keys.add(shape)
        kernels = self.fixed_shape if shape in self.fixed_keys else self.any_shape
        return kernels(query, key, value, block_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1],
                       **self.options)


@functools.cache
def flex_kernels() -> FlexKernels:
    return FlexKernels()


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

    @property
    def padded_size(self) -> int:
        """The token count FlexAttention runs on (:func:`padded_length`)."""
        return padded_length(self.forest.num_nodes)

    def _block_mask(self, window: int | None) -> object:
        # Padded nodes are their own subtrees (each sees itself: no empty softmax row) at position 0.
        end, pos = self.forest.subtree_end, self.forest.position_ids
        extra = self.padded_size - end.numel()
        end = torch.cat([end, torch.arange(end.numel(), self.padded_size, dtype=end.dtype, device=end.device)])
        pos = torch.cat([pos, pos.new_zeros(extra)])
        return forest_block_mask(end, pos, window)


def forest_block_mask(end: torch.Tensor, pos: torch.Tensor, window: int | None = None,
                      block: int = FLEX_BLOCK) -> object:
    """FlexAttention ``BlockMask`` of the forest rule, built from the forest's structure with a few
    vectorised torch ops: no dense ``T x T`` mask, no compilation, no host sync.

    ``create_block_mask`` would evaluate the rule on every (query, key) pair through
    ``torch.compile``, which recompiles for new sizes and closures (minutes per micro-batch shape
    in a training loop). The rule ``k <= q <= end[k]`` needs only block-wise extremes of ``end``:
    key block ``kb`` strictly before query block ``qb = [q0, q1]`` is *visible in part* iff
    ``max(end[kb]) >= q0`` and *fully* iff ``min(end[kb]) >= q1``; diagonal blocks are causal,
    hence partial; later blocks are invisible. Partial blocks apply the exact rule per element.
    (The ragged last block is never strictly before another, so it is never called full.)
    """
    from torch.nn.attention.flex_attention import BlockMask

    size = end.numel()
    blocks = -(-size // block)
    padded = torch.full((blocks * block,), -1, dtype=end.dtype, device=end.device)
    padded[:size] = end
    block_max, block_min = padded.view(blocks, block).amax(dim=1), padded.view(blocks, block).amin(dim=1)
    index = torch.arange(blocks, device=end.device)
    first_q = index * block
    last_q = torch.clamp(first_q + block - 1, max=size - 1)
    earlier = index[None, :] < index[:, None]  # [query block, key block]
    diagonal = torch.eye(blocks, dtype=torch.bool, device=end.device)
    any_visible = (earlier & (block_max[None, :] >= first_q[:, None])) | diagonal
    full = earlier & (block_min[None, :] >= last_q[:, None])
    if window is not None:  # a window cuts into blocks the structure calls full: they stay partial
        full = torch.zeros_like(full)
    partial = any_visible & ~full

    def visible(b, h, q, k):
        allowed = (k <= q) & (q <= end[k])
        return allowed & ((pos[q] - pos[k]) < window) if window is not None else allowed

    def indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = chosen.sum(dim=1, dtype=torch.int32)
        order = torch.argsort(chosen.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    kv_num, kv_index = indices(partial)
    full_num, full_index = indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=block, mask_mod=visible,
                                    seq_lengths=(size, size))


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
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs forest metadata; call it through "
                           "arctic_zorro.packed_forward")
    for unsupported in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"forest attention cannot apply {unsupported!r} exactly; disable zorro for "
                                      "this model")
    if dropout:
        raise NotImplementedError("forest attention runs without attention dropout (RL training uses none)")
    mask = forest.mask(sliding_window)
    if forest.use_flex:
        return _padded_flex_attention(query, key, value, forest, mask, sliding_window, scaling), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def _padded_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forest: ForestAttentionMeta,
                           mask: object, window: int | None, scaling: float | None) -> torch.Tensor:
    """FlexAttention on q/k/v padded token-major: ``[1, T, H, D]`` in memory, as the projections
    write them (q/k/v arrive as transposed views of that). Padding in that layout is a contiguous
    copy, FlexAttention's output follows the query's layout, and its first ``T`` tokens are then
    the ``[1, T, H, D]`` result as a view: no transposing copies forward or backward (padding
    head-major copied each tensor through a strided kernel, and the output once more)."""
    size, extra = query.shape[2], forest.padded_size - query.shape[2]
    query, key, value = (torch.nn.functional.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, extra)).transpose(1, 2)
                         for t in (query, key, value))
    out = flex_kernels()(query, key, value, mask, window, scaling)
    return out.transpose(1, 2)[:, :size]


AttentionInterface.register(ATTENTION_NAME, forest_attention)
