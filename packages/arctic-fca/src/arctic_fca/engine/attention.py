"""The engine's attention, plugged into transformers' attention registry.

Each layer's attention module computes its query/key/value (norms and rotary included, the model's
own code) and calls ``paged_attention``, which writes the step's keys/values into the paged cache and
attends over it:

- prefill: per sequence, its new tokens attend causally to its cached prefix (blocks another
  prompt already filled, e.g. a shared system prompt) and to themselves;
- decode: one token per sequence, through the step's prepared FCA / plain decode
  (``arctic_fca.fca.decode``), planned once per step for all layers;
- a mixed step: decode rows first, then prefill rows (a chunk of new prompts computed while the
  running sequences take one more token), each through its own path.

Step metadata reaches every layer through the model's ``**kwargs`` (``paged=...``). The engine's
own decoder (``decoder``) stores its keys/values itself and calls ``attend``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from arctic_core.compiling import bucketed_length
from arctic_fca.engine.kv_cache import PagedKVCache
from arctic_fca.fca.decode import PreparedDecode

logger = logging.getLogger(__name__)
ATTENTION_NAME = "arctic_fca_paged"
# A prompt's causal attention with nothing cached runs on cuDNN's kernels where torch has them (faster
# than flash attention's on long prompts: docs/design/fca.md), over q/k/v padded to one of 8 lengths
# per octave: cuDNN builds a plan for every new shape (host time, the device idle meanwhile), so prompts whose
# lengths keep changing would pay more for plans than for the attention. The padding is exact: padded
# keys come after every real query, which the causal mask already hides from them.
CUDNN_PREFILL = True
CUDNN_GRANULE = 128
# Everything else (cached prefixes, other devices and dtypes): flash attention needs no plan per shape.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's new tokens in a packed prefill: rows ``start:end`` of the step, preceded by
    ``cached`` tokens already in the cache (whose slots ``context_slots`` lists, new ones included)."""

    start: int
    end: int
    cached: int
    context_slots: torch.Tensor | None  # [cached + new] flat slots; None when nothing is cached


@dataclass(frozen=True)
class StepMetadata:
    cache: PagedKVCache
    slots: torch.Tensor  # [tokens] flat cache slot of every token of the step
    decode: PreparedDecode | None = None  # for the step's rows before the first span (all without spans)
    spans: tuple[PrefillSpan, ...] = ()  # the prefill rows, after the decode rows


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    paged: StepMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, Hkv, T, D]`` -> ``[1, T, H, D]``."""
    if paged is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs step metadata; run the model through EmbeddedEngine")
    if sliding_window is not None:
        raise NotImplementedError("the embedded engine has no sliding-window attention; use another sampler")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    paged.cache.write(module.layer_idx, paged.slots, k, v)
    return attend(q, k, v, module.layer_idx, paged, scale)[None], None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, paged: StepMetadata,
           scale: float) -> torch.Tensor:
    """Attention of the step's queries ``q [T, H, D]`` (their keys/values ``k, v [T, Hkv, D]``
    already in the cache) -> ``[T, H, D]``."""
    parts = []
    if paged.decode is not None:
        rows = paged.spans[0].start if paged.spans else q.shape[0]
        parts.append(paged.decode(q[:rows], paged.cache.keys[layer], paged.cache.values[layer], scale))
    if paged.spans:
        query, key, value = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, T, D]
        spans = [_prefill_span(query, key, value, paged.cache, layer, span, scale) for span in paged.spans]
        parts.append(torch.cat(spans, dim=2)[0].transpose(0, 1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _prefill_span(query, key, value, cache: PagedKVCache, layer: int, span: PrefillSpan, scale: float) -> torch.Tensor:
    q = query[:, :, span.start : span.end]
    gqa = query.shape[1] != key.shape[1]
    if span.context_slots is None:
        k, v = key[:, :, span.start : span.end], value[:, :, span.start : span.end]
        return causal_attention(q, k, v, scale, gqa)
    k, v = (c.view(-1, *c.shape[2:])[span.context_slots].transpose(0, 1)[None]
            for c in (cache.keys[layer], cache.values[layer]))
    if gqa:  # each query head's keys/values: flash (half precision) and memory-efficient attention
        # (fp32, no grouped-query support) then both apply the causal bias below without a dense mask
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    new = span.end - span.start
    # Causal, aligned to the last key: the new tokens see the whole cached prefix.
    visible = causal_lower_right(new, span.cached + new)
    with sdpa_kernel(PREFILL_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
    """Causal self-attention of one prompt, ``[1, heads, n, D]`` -> ``[1, heads, n, D]``."""
    global CUDNN_PREFILL
    if CUDNN_PREFILL and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return padded_causal_attention(q, k, v, scale, gqa)
        except RuntimeError as error:  # no cuDNN attention for this GPU or build: flash from now on
            logger.info("prefill attention on flash attention (cuDNN's unavailable: %s)", error)
            CUDNN_PREFILL = False
    with sdpa_kernel(PREFILL_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)



def padded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
    """:func:`causal_attention` over q/k/v padded to a length of :func:`bucketed_length` (the rows
    past ``n`` dropped): the padded keys follow every real query, so the causal mask hides them."""
    n = q.shape[2]
    padded = [F.pad(x, (0, 0, 0, bucketed_length(n, CUDNN_GRANULE) - n)) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*padded, is_causal=True, scale=scale, enable_gqa=gqa)[:, :, :n]


AttentionInterface.register(ATTENTION_NAME, paged_attention)
