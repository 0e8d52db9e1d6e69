"""FCA's additions to a vLLM attention backend, free of vLLM imports (so the CPU suite tests them
against stand-in bases); ``attention`` mixes them into vLLM's own backends.

- ``FCABuilderMixin``: a batch of single-token queries gets ``fca``, this step's work from
  ``DeviceWorkBuilder`` (built on the device from the block table, no host sync), besides the
  base's metadata. A mixed batch gets FCA work for its leading single-token queries (vLLM puts
  them first) and the base's metadata for the rest, where every layer of the builder runs FCA.
  Any other batch gets ``fca = None``. What the host knows (``host_step``, set by
  ``host_tables``) makes the build cheaper: a batch that shares no block is built plain
  without the forest search, and the same requests as the last step reuse its forest.
- ``FCAImplMixin``: ``forward`` runs FCA on the rows the metadata gives it, when the layer is one
  FCA computes exactly, and the base impl on the rest; anything else goes to the base unchanged.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from arctic_fca.fca.device_work import DeviceWorkBuilder
from arctic_fca.fca.triton_decode import triton_decode_attention

logger = logging.getLogger(__name__)
DECODER = "decoder"  # vLLM's AttentionType.DECODER (a str enum)


class HostStep(NamedTuple):
    """What the host knows of a step's requests, row by row (``host_tables``)."""

    first_blocks: np.ndarray  # each request's first KV block
    requests: np.ndarray | None  # an id per request, new whenever a slot takes a request; None: unknown


class FCABuilderMixin:
    """Adds ``fca`` (the step's work, or None), ``fca_rows`` (the leading rows FCA computes),
    ``fca_split`` (whether the base's metadata covers only the rows after them) and
    ``fca_block_size`` to the base's metadata."""

    # vLLM may reuse one group's metadata for another by swapping the block table; the FCA work
    # was built from this group's table, so it must be built afresh instead.
    supports_update_block_table = False
    # Single-token queries first: V1's runner reorders batches for builders that ask (V2's always
    # does), so a mixed batch's decode rows form one leading run that FCA can take.
    reorder_batch_threshold = 1
    # This step's requests as the host knows them, or None where it does not (set by
    # ``host_tables.attach_host_tables``); unknown: the device searches for a forest.
    host_step: Callable[[], HostStep | None] | None = None

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        """The base's level, at most UNIFORM_BATCH: how a mixed batch splits between FCA and the
        base is decided per step on the host, which a full graph of a mixed batch would freeze at
        capture (vLLM then runs mixed batches piecewise, attention outside the graph)."""
        support = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        cap = type(support)["UNIFORM_BATCH"]  # vLLM's AttentionCGSupport, by name (no vLLM import)
        return support if support.value <= cap.value else cap

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        scheduler, compilation = vllm_config.scheduler_config, vllm_config.compilation_config
        self.max_requests = max(scheduler.max_num_seqs, compilation.max_cudagraph_capture_size or 0)
        self.cache_config, self.spec = vllm_config.cache_config, kv_cache_spec
        self.num_q_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.work_builder: DeviceWorkBuilder | None = None
        self.layers = [compilation.static_forward_context.get(name) for name in layer_names]
        self.layers_run_fca: bool | None = None  # known once the KV cache is bound to the layers
        self.steps = {"decode": 0, "mixed": 0, "base": 0}  # how batches went, for metrics

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cam = common_attn_metadata
        rows = self._fca_rows(cam)
        split = 0 < rows < cam.num_reqs
        # A mixed batch: the base gets the rows after FCA's (no vLLM cascade: FCA reads the
        # shared prefixes of the decode rows itself).
        meta = super().build(0, _rows_after(cam, rows), fast_build) if split else super().build(
            common_prefix_len, cam, fast_build)
        meta.fca, meta.fca_rows, meta.fca_split, meta.fca_block_size = None, 0, split, self.spec.block_size
        if rows and not meta.use_cascade:
            tables, seq_lens = cam.block_table_tensor[:rows], cam.seq_lens[:rows]
            shared, key = self._host_knows(rows)
            meta.fca = self._work_builder(tables).build(tables, seq_lens, shared=shared, forest_key=key)
            meta.fca_rows = rows
        self.steps["mixed" if split else "decode" if meta.fca is not None else "base"] += 1
        return meta

    def _fca_rows(self, cam) -> int:
        """How many leading requests FCA computes: all of a batch of single-token queries; the
        leading single-token queries of a mixed batch where every layer of this builder runs FCA
        (the base's metadata then covers only the rest); else none. Host-side facts only."""
        if cam.causal is not True or cam.num_reqs < 2:
            return 0
        if cam.max_query_len == 1:
            return cam.num_reqs
        if not self._layers_run_fca():
            return 0
        query_lens = np.diff(cam.query_start_loc_cpu[: cam.num_reqs + 1].numpy())
        rows = int(np.argmax(query_lens != 1))  # the first row with more (a mixed batch has one)
        return rows if rows >= 2 else 0

    def _layers_run_fca(self) -> bool:
        """Whether every layer this builder serves computes FCA (a split batch has no metadata for
        the base to run the FCA rows of a layer that cannot)."""
        if not self.layers:
            return False
        if self.layers_run_fca is None:
            caches = [getattr(layer, "kv_cache", None) for layer in self.layers]
            if not all(isinstance(cache, torch.Tensor) and cache.dim() == 5 for cache in caches):
                return False  # not bound yet (profiling, capture): ask again later
            self.layers_run_fca = all(getattr(layer.impl, "fca_exact", False) for layer in self.layers) and all(
                cache.shape[2] == self.spec.block_size for cache in caches)
        return self.layers_run_fca

    def _host_knows(self, rows: int) -> tuple[bool, bytes | None]:
        """(whether the first ``rows`` requests may share a block, their forest key or None). False
        when the host knows that no two of them share a block. A host view that fails (vLLM's
        internals moved) is dropped with a warning: the device then searches every batch, as
        without it (plain or FCA, the result is exact either way)."""
        if self.host_step is None:
            return True, None
        try:
            step = self.host_step()
        except Exception as error:  # noqa: BLE001 - any failure of a duck-typed view of vLLM
            logger.warning("FCA: the host's block tables cannot be read (%r); the device searches every "
                           "batch for shared prefixes from now on", error)
            self.host_step = None
            return True, None
        if step is None:
            return True, None
        if not shares_a_block(step.first_blocks[:rows]):
            return False, None
        return True, None if step.requests is None else step.requests[:rows].tobytes()

    def _work_builder(self, tables: torch.Tensor) -> DeviceWorkBuilder:
        if self.work_builder is None:  # first build: the block table's width is known from here on
            self.work_builder = DeviceWorkBuilder(
                self.max_requests, tables.shape[1], self.cache_config.num_gpu_blocks, self.spec.block_size,
                num_q_heads=self.num_q_heads, num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_size,
                kv_dtype=self.spec.dtype, device=tables.device)
        return self.work_builder


def fca_builders(runner) -> list[tuple[int, FCABuilderMixin]]:
    """The FCA metadata builders of a vLLM model runner, each with its KV-cache group's index."""
    return [(group_id, builder) for group_id, groups in enumerate(runner.attn_groups)
            for builder in (b for group in groups for b in group.metadata_builders)
            if isinstance(builder, FCABuilderMixin)]


def _rows_after(cam, rows: int):
    """``cam`` (vLLM's CommonAttentionMetadata) for its requests from ``rows`` on, whose tokens
    follow the first ``rows`` single-token queries (a copy; the runner's own stays whole)."""
    part = copy.copy(cam)
    part.query_start_loc = cam.query_start_loc[rows:] - rows
    part.query_start_loc_cpu = cam.query_start_loc_cpu[rows:] - rows
    part.num_reqs, part.num_actual_tokens = cam.num_reqs - rows, cam.num_actual_tokens - rows
    part.slot_mapping, part.positions = cam.slot_mapping[rows:], _after(cam.positions, rows)
    for name in ("seq_lens", "block_table_tensor", "is_prefilling", "seq_lens_cpu_upper_bound", "dcp_local_seq_lens",
                 "_seq_lens_cpu", "_num_computed_tokens_cpu"):  # per request
        setattr(part, name, _after(getattr(cam, name, None), rows))
    part._num_computed_tokens_cache = None  # derived from the whole batch's lengths
    return part


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
            if getattr(attn_metadata, "fca_split", False):  # the builder checked its layers: a bug
                raise RuntimeError(f"FCA: layer {getattr(layer, 'layer_name', layer)!r} cannot run FCA, but its "
                                   "mixed batch's metadata leaves the decode rows to FCA")
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        rows = attn_metadata.fca_rows  # one query token each
        key_cache, value_cache = kv_cache.unbind(1)  # the current token was written before forward
        out = output[:rows].view(rows, self.num_heads, self.head_size)
        triton_decode_attention(query[:rows], key_cache, value_cache, work, self.scale, out=out)
        if attn_metadata.fca_split:  # the base's metadata describes the tokens after FCA's rows
            super().forward(layer, query[rows:], _after(key, rows), _after(value, rows), kv_cache, attn_metadata,
                            output[rows:])
        return output


def _after(tensor: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows:]
