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
    """The radix tree of the requests' full-block sequences, flattened (see the module docstring)."""
    validate_block_tables(block_tables, seq_lens, block_size)
    tables = block_tables.cpu()
    full_blocks = (seq_lens.cpu() // block_size).tolist()
    suffix_start = [0] * len(full_blocks)
    nodes: list[tuple[int, int, int, list[int]]] = []  # (parent, first block pos, end pos, requests)
    # Depth-first with an explicit stack (a deep staircase of prefixes must not hit Python's
    # recursion limit); each entry is a set of >= 2 requests that agree on the block at `pos`.
    stack = [(-1, 0, group) for group in reversed(_split(tables, full_blocks, range(len(full_blocks)), 0, suffix_start))]
    while stack:
        parent, pos, group = stack.pop()
        end = _run_end(tables, full_blocks, group, pos)
        nodes.append((parent, pos, end, group))
        children = _split(tables, full_blocks, group, end, suffix_start)
        stack.extend((len(nodes) - 1, end, child) for child in reversed(children))
    return _flatten(tables, seq_lens.cpu(), block_size, nodes, suffix_start)


def _split(tables: torch.Tensor, full_blocks: list[int], requests, pos: int, suffix_start: list[int]) -> list[list[int]]:
    """Group `requests` by their block at `pos`; groups of >= 2 go on sharing, the rest leave the
    tree here (their suffix starts at `pos`)."""
    column = tables[:, pos].tolist() if pos < tables.shape[1] else []
    by_block: dict[int, list[int]] = {}
    for r in requests:
        if full_blocks[r] > pos:
            by_block.setdefault(column[r], []).append(r)
        else:
            suffix_start[r] = pos
    groups = []
    for members in by_block.values():
        if len(members) >= 2:
            groups.append(members)
        else:
            suffix_start[members[0]] = pos
    return sorted(groups, key=lambda members: members[0])


def _run_end(tables: torch.Tensor, full_blocks: list[int], group: list[int], pos: int) -> int:
    """First position past `pos` where the group stops agreeing (a divergence, or a member's full
    blocks run out): the node is maximal for exactly this set of requests."""
    limit = min(full_blocks[r] for r in group)
    rows = tables[group, pos:limit]
    agree = (rows == rows[0]).all(dim=0)
    disagreements = (~agree).nonzero()
    return pos + (int(disagreements[0]) if disagreements.numel() else rows.shape[1])


def _flatten(tables, seq_lens, block_size, nodes, suffix_start) -> FCAPlan:
    def indptr(sizes: list[int]) -> torch.Tensor:
        return torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32)

    def int32(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    kv_runs = [tables[group[0], pos:end] for _, pos, end, group in nodes]
    start = int32(suffix_start)
    return FCAPlan(
        block_size=block_size,
        num_requests=len(suffix_start),
        node_kv_indptr=indptr([end - pos for _, pos, end, _ in nodes]),
        node_kv_indices=torch.cat(kv_runs).to(torch.int32) if kv_runs else int32([]),
        node_q_indptr=indptr([len(group) for *_, group in nodes]),
        node_q_indices=int32([r for *_, group in nodes for r in group]),
        node_parent=int32([parent for parent, *_ in nodes]),
        suffix_block_start=start,
        suffix_lens=(seq_lens - start * block_size).to(torch.int32),
    )
