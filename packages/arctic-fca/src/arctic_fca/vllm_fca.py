"""FCA's additions to a vLLM attention backend, free of vLLM imports (so the CPU suite tests them
against stand-in bases); ``vllm_attention`` mixes them into vLLM's own backends.

- ``FCABuilderMixin``: after the base builder's ``build``, a batch of pure single-token decode
  steps also gets ``fca`` (this step's work from ``DeviceWorkBuilder``, built on the device from
  the block table, no host sync) and ``fca_block_size``; any other batch gets ``fca = None``.
  A batch the host knows shares no block (``host_first_blocks``, set by ``vllm_host_tables``)
  is built plain at once (``DeviceWorkBuilder.build(shared=False)``: no forest search).
- ``FCAImplMixin``: ``forward`` runs FCA when the metadata carries work and the layer is one FCA
  computes exactly; everything else goes to the base impl unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from arctic_fca.fca.device_work import DeviceWorkBuilder
from arctic_fca.fca.triton_decode import triton_decode_attention
from arctic_fca.vllm_plugin import COMPILE_ENV

logger = logging.getLogger(__name__)
DECODER = "decoder"  # vLLM's AttentionType.DECODER (a str enum)


class FCABuilderMixin:
    """Adds ``fca`` (the step's work, or None) and ``fca_block_size`` to the base's metadata."""

    # vLLM may reuse one group's metadata for another by swapping the block table; the FCA work
    # was built from this group's table, so it must be built afresh instead.
    supports_update_block_table = False
    # The first block of each of this step's requests as the host knows it, or None where it does
    # not (set by ``vllm_host_tables.attach_host_tables``); unknown: the device searches for a forest.
    host_first_blocks: Callable[[], np.ndarray | None] | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        scheduler, compilation = vllm_config.scheduler_config, vllm_config.compilation_config
        self.max_requests = max(scheduler.max_num_seqs, compilation.max_cudagraph_capture_size or 0)
        self.cache_config, self.spec = vllm_config.cache_config, kv_cache_spec
        self.num_q_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.work_builder: DeviceWorkBuilder | None = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta.fca, meta.fca_block_size = None, self.spec.block_size
        cam = common_attn_metadata
        # Host-side facts only (no sync): a batch of single-token queries, no vLLM cascade.
        if cam.max_query_len == 1 and not meta.use_cascade and cam.num_reqs > 1 and cam.causal is True:
            tables, seq_lens = cam.block_table_tensor[: cam.num_reqs], cam.seq_lens[: cam.num_reqs]
            meta.fca = self._work_builder(tables).build(tables, seq_lens, shared=self._may_share())
        return meta

    def _may_share(self) -> bool:
        """False when the host knows that no two of this step's requests share a block. A host
        view that fails (vLLM's internals moved) is dropped with a warning: the device then
        searches every batch, as without it (plain or FCA, the result is exact either way)."""
        if self.host_first_blocks is None:
            return True
        try:
            first_blocks = self.host_first_blocks()
        except Exception as error:  # noqa: BLE001 - any failure of a duck-typed view of vLLM
            logger.warning("FCA: the host's block tables cannot be read (%r); the device searches every "
                           "batch for shared prefixes from now on", error)
            self.host_first_blocks = None
            return True
        return first_blocks is None or shares_a_block(first_blocks)

    def _work_builder(self, tables: torch.Tensor) -> DeviceWorkBuilder:
        if self.work_builder is None:  # first build: the block table's width is known from here on
            self.work_builder = DeviceWorkBuilder(
                self.max_requests, tables.shape[1], self.cache_config.num_gpu_blocks, self.spec.block_size,
                num_q_heads=self.num_q_heads, num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_size,
                kv_dtype=self.spec.dtype, device=tables.device, compile_backend=os.environ.get(COMPILE_ENV) or None)
        return self.work_builder


def shares_a_block(first_blocks: np.ndarray) -> bool:
    """Whether two of the requests whose first KV blocks these are share any block. Prefix caching
    gives one block id to one token prefix, so requests that share a block share their first."""
    return np.unique(first_blocks).size < first_blocks.size


class FCAImplMixin:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # What FCA computes exactly: plain causal softmax attention over an unquantized cache.
        self.fca_exact = (self.sliding_window == (-1, -1) and self.alibi_slopes is None and not self.logits_soft_cap
                          and self.sinks is None and self.attn_type == DECODER
                          and self.kv_cache_dtype == "auto" and self.dcp_world_size == 1)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        work = getattr(attn_metadata, "fca", None)
        # The cache's block size must be the one the block table counts in (vLLM may split a
        # manager block into smaller kernel blocks for some models).
        if (work is None or not self.fca_exact or kv_cache.shape[2] != attn_metadata.fca_block_size
                or output_scale is not None or output_block_scale is not None):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        num_requests = attn_metadata.num_actual_tokens  # one query token each
        key_cache, value_cache = kv_cache.unbind(1)  # the current token was written before forward
        out = output[:num_requests].view(num_requests, self.num_heads, self.head_size)
        triton_decode_attention(query[:num_requests], key_cache, value_cache, work, self.scale, out=out)
        return output
