"""The FCA plan: the forest of shared block prefixes of one decode batch, as flat tensors.

Requests that share a prompt point their block tables at the same physical KV blocks. Read as
sequences of block ids from position 0, the block tables form a radix tree; every tree node that
two or more requests pass through is a run of blocks FCA reads once for all of them. Built on the
host once per batch (the block tables change only when a request crosses a block boundary).

Layout (all int32, on the host; ``plan.to(device)`` for a kernel; CSR naming as in FlashInfer,
``X_indptr[i] : X_indptr[i + 1]`` slices ``X_indices``)::

    node_kv_indptr  [num_nodes + 1]   node n reads blocks node_kv_indices[node_kv_indptr[n]:node_kv_indptr[n+1]]
    node_kv_indices [num_node_blocks] physical block ids, in token order; every one is FULL
    node_q_indptr   [num_nodes + 1]   node n serves requests node_q_indices[node_q_indptr[n]:node_q_indptr[n+1]]
    node_q_indices  [num_node_rows]   request ids (ascending within a node), >= 2 per node
    node_parent     [num_nodes]       parent node id, -1 for a root; parents precede children
    suffix_block_start [num_requests] the request's own suffix begins at block_tables[r, suffix_block_start[r]]
    suffix_lens     [num_requests]    tokens in that suffix (0 when the whole sequence is shared)

A request's KV is exactly the blocks of the nodes on its root-to-leaf path (which are
``block_tables[r, :suffix_block_start[r]]``, in order) followed by its suffix. The suffix is kept
as a start offset into the caller's block table rather than copied, so a plain paged-decode
kernel with a per-request start reads it unchanged. Singletons (requests sharing nothing) have
``suffix_block_start == 0``: their whole sequence is suffix.

Node ``n``'s partial result for its ``j``-th request is row ``node_q_indptr[n] + j`` of the partial
buffers; the suffix of request ``r`` is row ``num_node_rows + r``. The merge reads those rows.

A block is shareable only if it is full for every request in the node: only full blocks enter the
tree, so a partially filled last block (still being written) always stays in its request's suffix.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from arctic_fca.fca.layout import DecodeShape, validate_block_tables


@dataclass(frozen=True)
class FCAPlan:
    block_size: int
    num_requests: int
    node_kv_indptr: torch.Tensor
    node_kv_indices: torch.Tensor
    node_q_indptr: torch.Tensor
    node_q_indices: torch.Tensor
    node_parent: torch.Tensor
    suffix_block_start: torch.Tensor
    suffix_lens: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.node_parent.numel()

    @property
    def num_node_rows(self) -> int:
        """Partial results the node passes produce (one per node per request below it)."""
        return self.node_q_indices.numel()

    @property
    def num_partial_rows(self) -> int:
        return self.num_node_rows + self.num_requests

    def node_blocks(self, node: int) -> list[int]:
        return self.node_kv_indices[self.node_kv_indptr[node]:self.node_kv_indptr[node + 1]].tolist()

    def node_requests(self, node: int) -> list[int]:
        return self.node_q_indices[self.node_q_indptr[node]:self.node_q_indptr[node + 1]].tolist()

    def plain_kv_tokens(self) -> int:
        """KV tokens plain decode reads: every request's whole sequence."""
        node_tokens = self.node_kv_indptr.diff() * self.block_size
        return int((node_tokens * self.node_q_indptr.diff()).sum() + self.suffix_lens.sum())

    def fca_kv_tokens(self) -> int:
        """KV tokens FCA reads: each node once, plus every suffix."""
        return self.node_kv_indices.numel() * self.block_size + int(self.suffix_lens.sum())

    def for_seq_lens(self, seq_lens: torch.Tensor) -> FCAPlan:
        """The same tree for sequences that grew inside their last blocks (no block filled up):
        only the suffix lengths change. Callers check that no request's full-block count moved."""
        return replace(self, suffix_lens=(seq_lens.cpu() - self.suffix_block_start * self.block_size).to(torch.int32))

    def to(self, device: torch.device | str) -> FCAPlan:
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def check_matches(self, shape: DecodeShape) -> None:
        if (self.num_requests, self.block_size) != (shape.num_requests, shape.block_size):
            raise ValueError(f"plan was built for {self.num_requests} requests at block_size {self.block_size}, "
                             f"the batch has {shape.num_requests} at block_size {shape.block_size}")


def build_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> FCAPlan:
    """The radix tree of the requests' full-block sequences, flattened (see the module docstring).

    The engine builds it on the host while a decode step runs, at every step where a sample leaves
    (in RL rollouts, most steps), so it is built with a few array operations rather than node by
    node: sorted, the full-block sequences that share a prefix lie side by side, and each node is
    an interval of sorted requests whose common prefix (the smallest of their neighbours' common
    prefixes) is longer than the interval's around it ("lcp intervals", as in suffix arrays)."""
    validate_block_tables(block_tables, seq_lens, block_size)
    tables = block_tables.cpu().numpy()
    full_blocks = seq_lens.cpu().numpy().astype(np.int64) // block_size
    order, common = _sorted_common_prefixes(tables, full_blocks)
    # A request leaves the tree where it stops sharing with both neighbours: its suffix starts there.
    suffix_start = np.zeros(len(full_blocks), dtype=np.int64)
    suffix_start[order] = np.maximum(np.r_[0, common], np.r_[common, 0])
    nodes = _ordered(_intervals(common), order.tolist())
    return _flatten(tables, seq_lens.cpu(), block_size, nodes, suffix_start)


def _sorted_common_prefixes(tables: np.ndarray, full_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The requests in an order where those sharing a prefix are adjacent (each table row as one
    byte string: any fixed order of rows works), and each adjacent pair's shared full blocks."""
    width = int(full_blocks.max()) if len(tables) else 0  # only full blocks are shared
    if len(tables) < 2 or width == 0:
        return np.arange(len(tables)), np.zeros(max(0, len(tables) - 1), dtype=np.int64)
    columns = np.arange(width)
    rows = np.where(columns < full_blocks[:, None], tables[:, :width], -1)  # past its full blocks: never shared
    as_bytes = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.itemsize * width))).ravel()
    order = np.argsort(as_bytes, kind="stable")
    rows, full = rows[order], full_blocks[order]
    differ = (rows[:-1] != rows[1:]) | (columns >= np.minimum(full[:-1], full[1:])[:, None])
    common = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
    return order, common


def _intervals(common: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Every interval of sorted requests sharing more blocks than its parent interval: (parent's
    shared blocks, its shared blocks, first, last), parents after their children."""
    found = []
    stack = [[0, 0]]  # (shared blocks, first) of the open intervals, outermost first
    for i, shared in enumerate([*common.tolist(), 0]):  # pair (i, i + 1); the final 0 closes all
        first = i
        while shared < stack[-1][0]:
            depth, first = stack.pop()
            found.append((max(shared, stack[-1][0]), depth, first, i))
        if shared > stack[-1][0]:
            stack.append([shared, first])
    return found


def _ordered(intervals: list[tuple[int, int, int, int]], order: list[int]) -> list[tuple[int, int, int, list[int]]]:
    """The nodes (parent index, first block, end block, requests ascending) depth first, parents
    before children and siblings by their first request, as the kernels' partial rows are laid out."""
    members = [sorted(order[first:last + 1]) for _, _, first, last in intervals]
    children: dict[int, list[int]] = {}
    open_below: list[int] = []  # intervals found so far whose parent is not found yet
    for index, (_, _, first, _last) in enumerate(intervals):  # children are found before their parent
        while open_below and intervals[open_below[-1]][2] >= first:
            children.setdefault(index, []).append(open_below.pop())
        open_below.append(index)
    nodes: list[tuple[int, int, int, list[int]]] = []
    stack = [(-1, index) for index in sorted(open_below, key=lambda i: members[i][0], reverse=True)]
    while stack:
        parent, index = stack.pop()
        start, end, _, _ = intervals[index]
        nodes.append((parent, start, end, members[index]))
        below = sorted(children.get(index, []), key=lambda i: members[i][0], reverse=True)
        stack.extend((len(nodes) - 1, child) for child in below)
    return nodes


def _flatten(tables: np.ndarray, seq_lens: torch.Tensor, block_size: int, nodes: list,
             suffix_start: np.ndarray) -> FCAPlan:
    def indptr(sizes: list[int]) -> torch.Tensor:
        return torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32)

    def int32(values) -> torch.Tensor:
        return torch.from_numpy(np.asarray(values, dtype=np.int32))

    kv_runs = [tables[group[0], pos:end] for _, pos, end, group in nodes]
    start = int32(suffix_start)
    return FCAPlan(
        block_size=block_size,
        num_requests=len(suffix_start),
        node_kv_indptr=indptr([end - pos for _, pos, end, _ in nodes]),
        node_kv_indices=int32(np.concatenate(kv_runs) if kv_runs else []),
        node_q_indptr=indptr([len(group) for *_, group in nodes]),
        node_q_indices=int32([r for *_, group in nodes for r in group]),
        node_parent=int32([parent for parent, *_ in nodes]),
        suffix_block_start=start,
        suffix_lens=(seq_lens - start * block_size).to(torch.int32),
    )
