"""Fixed-capacity device buffers for decode attention inside a CUDA graph.

A graph replays the same kernel launches with the same grids and pointers, so the step's work
items (``arctic_fca.fca.work``) go into buffers allocated once, at capacity: the grids cover the
capacity and programs past the step's item count do nothing (the kernel reads the count). Each
step costs two host-to-device copies (one packed int32 metadata buffer, and the shared nodes'
block ids); the block tables, as wide as the batch's longest (the buffers hold the widest a model
allows), are copied only when the batch's sequences change. The copies never
wait for the device: each goes out of a fresh pinned buffer (the caching host allocator keeps it
until its copy ran), so steps can be queued while earlier ones still run. A step whose work does
not fit returns False from ``load`` and runs eagerly instead.
"""

from __future__ import annotations

import numpy as np
import torch

from arctic_fca.fca.work import DeviceLaunch, DeviceWork, item_columns
from arctic_fca.fca.tuning import DEFAULT_TUNING, Tuning
from arctic_fca.fca.work import DecodeWork


class StaticDecodeWork:
    """Buffers for the work of ``num_requests`` rows, with a shared-node launch or not."""

    def __init__(self, num_requests: int, table_width: int, max_node_blocks: int, *, with_nodes: bool,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 tuning: Tuning = DEFAULT_TUNING) -> None:
        self.num_requests, self.table_width, self.with_nodes = num_requests, table_width, with_nodes
        items_cap = 2 * num_requests + 1024
        self.caps = {"node_items": items_cap if with_nodes else 0, "single_items": items_cap,
                     "q_index": 9 * num_requests, "merge_rows": 24 * num_requests + 4096, "node_kv": max_node_blocks}
        sections = [("node_items", 5 * self.caps["node_items"]), ("single_items", 5 * items_cap), ("counts", 2),
                    ("q_index", self.caps["q_index"]), ("merge_indptr", num_requests + 1),
                    ("merge_rows", self.caps["merge_rows"])]
        total = sum(size for _, size in sections)
        self.meta_host = np.zeros(total, dtype=np.int32)
        self.meta = torch.zeros(total, dtype=torch.int32, device=device)
        self.host, self.dev, offset = {}, {}, 0
        for name, size in sections:
            self.host[name] = self.meta_host[offset : offset + size]
            self.dev[name] = self.meta[offset : offset + size]
            offset += size
        self.tables_size = num_requests * table_width
        self.kv_index = torch.zeros(self.tables_size + max(1, max_node_blocks), dtype=torch.int32, device=device)
        rows = self.caps["merge_rows"]
        group = num_q_heads // num_kv_heads

        def launch(name: str, index: int, requests_per_tile: int) -> DeviceLaunch:
            cap = self.caps[name]
            return DeviceLaunch(self.dev[name].view(5, cap), self.dev["counts"][index : index + 1], requests_per_tile)

        self.work = DeviceWork(
            kv_index=self.kv_index,
            q_index=self.dev["q_index"],
            node=launch("node_items", 0, tuning.per_tile(group)) if with_nodes else None,
            single=launch("single_items", 1, 1),
            merge_indptr=self.dev["merge_indptr"],
            merge_rows=self.dev["merge_rows"],
            partial=torch.zeros(rows, num_q_heads, head_dim, dtype=torch.float32, device=device),
            lse=torch.zeros(rows, num_q_heads, dtype=torch.float32, device=device),
            direct=False,
            tuning=tuning,
        )

    def fits(self, work: DecodeWork) -> bool:
        node_items = work.node.num_items if work.node is not None else 0
        return ((work.node is not None) == self.with_nodes and work.table_width <= self.table_width
                and work.merge_indptr.size == self.num_requests + 1 and node_items <= self.caps["node_items"]
                and work.single.num_items <= self.caps["single_items"] and work.q_index.size <= self.caps["q_index"]
                and work.num_partial_rows <= self.caps["merge_rows"] and work.node_kv.size <= self.caps["node_kv"])

    def load(self, work: DecodeWork, tables: np.ndarray | None) -> bool:
        """Copy a step's work in (``tables``: new block tables, None when unchanged); False if it
        does not fit these buffers."""
        if not self.fits(work):
            return False
        for name, launch in (("node_items", work.node), ("single_items", work.single)):
            if launch is not None:
                self.host[name].reshape(5, -1)[:, : launch.num_items] = item_columns(launch)[:, : launch.num_items]
        self.host["counts"][:] = (work.node.num_items if work.node is not None else 0, work.single.num_items)
        self.host["q_index"][: work.q_index.size] = work.q_index
        self.host["merge_indptr"][:] = work.merge_indptr
        self.host["merge_rows"][: work.merge_rows.size] = work.merge_rows
        copy_in(self.meta, self.meta_host)
        rows_size = self.num_requests * work.table_width  # the tables' rows, then the nodes' blocks
        if tables is not None:
            copy_in(self.kv_index[:rows_size], tables.reshape(-1))
        if work.node_kv.size:
            copy_in(self.kv_index[rows_size : rows_size + work.node_kv.size], work.node_kv)
        return True


def copy_in(target: torch.Tensor, values: np.ndarray) -> None:
    """``target[:] = values`` without waiting for the device (a pinned copy of ``values`` on CUDA)."""
    source = torch.from_numpy(np.ascontiguousarray(values)).to(target.dtype)
    target.copy_(source.pin_memory() if target.is_cuda else source, non_blocking=True)
