"""CUDA graphs of the decode step: the model's forward and LM head replayed without the host.

An eager decode step of a 28-layer model costs tens of milliseconds of Python and kernel-launch
time, more than its GPU work at RL batch sizes. Each graph here is captured once per
(batch-size bucket, FCA or plain) and replayed every step: the batch is padded to the bucket with
dummy sequences that read and write only the reserved scratch block 0, and the attention's work
items go through fixed-capacity buffers (``arctic_fca.fca.graph_work``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from arctic_fca.engine.attention import StepMetadata
from arctic_fca.engine.kv_cache import PagedKVCache
from arctic_fca.fca.decode import PreparedDecode
from arctic_fca.fca.graph_work import StaticDecodeWork, copy_in
from arctic_fca.fca.tuning import Tuning
from arctic_fca.fca.work import DecodeWork

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    work: StaticDecodeWork
    inputs: torch.Tensor  # [3, B]: token ids, positions, cache slots (one copy in per step)
    logits: torch.Tensor  # [B, vocab], the model's dtype
    tables_key: object = None  # whose block tables the work's kv_index holds


class DecodeGraphs:
    def __init__(self, logits: Callable[..., torch.Tensor], cache: PagedKVCache, *, table_width: int, max_num_seqs: int,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, tuning: Tuning) -> None:
        self.logits, self.cache, self.tuning = logits, cache, tuning  # logits(input_ids, positions, meta)
        self.table_width, self.heads = table_width, (num_q_heads, num_kv_heads, head_dim)
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.graphs: dict[tuple[int, bool], _Graph] = {}
        self.misfits = 0  # steps whose work did not fit their graph's buffers (run eagerly)
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, num_requests: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_requests)]

    def clear(self) -> None:
        """Drop every graph (they hold pointers into the KV cache, freed by sleep, and the weights)."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()  # the freed graphs' pool cannot take new captures

    def run(self, ids: np.ndarray | torch.Tensor, positions: np.ndarray, slots: np.ndarray, work: DecodeWork,
            tables: np.ndarray, tables_key: object) -> torch.Tensor | None:
        """Replay (capturing first if needed) the graph for this padded step; the logits ``[B,
        vocab]`` of the padded batch, or None when the work does not fit (run eagerly then).
        ``ids`` on the device (the previous step's samples) are copied in on the device."""
        key = (positions.size, work.node is not None)
        graph = self.graphs.get(key)
        fresh = graph is None
        if fresh:
            graph = self._allocate(positions.size, with_nodes=key[1])
        if not graph.work.load(work, tables if graph.tables_key != tables_key else None):
            self.misfits += 1
            return None
        graph.tables_key = tables_key
        on_device = isinstance(ids, torch.Tensor)
        host = np.stack((np.zeros_like(positions) if on_device else ids, positions, slots))
        copy_in(graph.inputs, host)  # never waits: the steps queued before this one may still run
        if on_device:
            graph.inputs[0].copy_(ids)
        if fresh:
            self._capture(graph)
            self.graphs[key] = graph
        graph.graph.replay()
        return graph.logits

    def _allocate(self, batch: int, with_nodes: bool) -> _Graph:
        device = self.cache.device
        num_q_heads, num_kv_heads, head_dim = self.heads
        work = StaticDecodeWork(batch, self.table_width, self.cache.num_blocks, with_nodes=with_nodes,
                                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, device=device,
                                tuning=self.tuning)

        inputs = torch.zeros(3, batch, dtype=torch.long, device=device)
        return _Graph(torch.cuda.CUDAGraph(), work, inputs, logits=None)

    def _forward(self, graph: _Graph) -> torch.Tensor:
        decode = PreparedDecode(None, None, None, "triton", graph.work.work)
        input_ids, positions, slots = graph.inputs
        return self.logits(input_ids, positions, StepMetadata(self.cache, slots, decode=decode))

    def _capture(self, graph: _Graph) -> None:
        # Warm up on a side stream (compiles the Triton kernels, settles the allocator), then record.
        # Both run the real step: their K/V writes store the same values the replay stores.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(graph)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph.graph, pool=self.pool):
            graph.logits = self._forward(graph)
