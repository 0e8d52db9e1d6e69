"""The prefix forest: every distinct token prefix of a batch stored once, packed without padding.

Sequences (``prompt + response`` per row) are inserted into a token trie: identical prompts,
shared system prompts, and multi-turn branches that share only part of a prefix all share nodes.
Nodes are packed in depth-first pre-order, so

* a node's ancestors come before it, and its subtree is the contiguous range
  ``[node, subtree_end[node]]``;
* token ``q`` may attend to token ``k`` exactly when ``k`` is an ancestor-or-self of ``q``, i.e.
  ``k <= q <= subtree_end[k]``: one integer per token describes the whole attention pattern;
* a node's position id is its depth, the position it has in every sequence through it.

Built with one lexicographic sort of the rows: in sorted order each row adds only the tokens past
its longest common prefix with the row before it, and those tokens are exactly its new trie nodes.
All index work is host-side once per micro-batch; nothing here runs per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arctic_core.batch import RolloutBatch, to_device


@dataclass(frozen=True)
class PackedForest:
    """A micro-batch as a packed prefix forest (all tensors 1-D, on one device)."""

    input_ids: torch.Tensor
    """``[T]`` token of each node."""
    position_ids: torch.Tensor
    """``[T]`` depth of each node (its position in every sequence through it)."""
    subtree_end: torch.Tensor
    """``[T]`` last packed index of each node's subtree."""
    row_paths: list[torch.Tensor]
    """Per batch row, ``[len(prompt) + len(response)]`` packed index of each of its tokens."""
    naive_tokens: int
    """Tokens of the plain batch, for the dedup ratio."""

    @property
    def num_nodes(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def dedup_ratio(self) -> float:
        return self.naive_tokens / max(self.num_nodes, 1)

    def dense_mask(self) -> torch.Tensor:
        """``[T, T]`` bool, True where query ``q`` may attend key ``k`` (for the exact CPU path)."""
        idx = torch.arange(self.num_nodes, device=self.subtree_end.device)
        q, k = idx[:, None], idx[None, :]
        return (k <= q) & (q <= self.subtree_end[None, :])

    def to(self, device: torch.device | str) -> PackedForest:
        """The tensors a forward reads on ``device``; the row paths (index bookkeeping, see
        :func:`response_gather_index`) stay on the host."""
        return PackedForest(
            to_device(self.input_ids, device),
            to_device(self.position_ids, device),
            to_device(self.subtree_end, device),
            self.row_paths,
            self.naive_tokens,
        )


def build_forest(batch: RolloutBatch) -> PackedForest:
    """Pack ``batch`` as a prefix forest (see module doc)."""
    sequences, order, shared_with_previous = batch.prefix_order()
    new_tokens: list[torch.Tensor] = []
    new_positions: list[torch.Tensor] = []
    paths: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(sequences)
    previous: int | None = None
    packed = 0
    for row, shared in zip(order, shared_with_previous, strict=True):
        seq = sequences[row]
        fresh = seq.shape[0] - shared
        new_tokens.append(seq[shared:])
        new_positions.append(torch.arange(shared, seq.shape[0]))
        prefix = paths[previous][:shared] if previous is not None else paths[row][:0]
        paths[row] = torch.cat([prefix, torch.arange(packed, packed + fresh)])
        packed += fresh
        previous = row
    input_ids = torch.cat(new_tokens) if new_tokens else torch.empty(0, dtype=torch.long)
    position_ids = torch.cat(new_positions) if new_positions else torch.empty(0, dtype=torch.long)
    return PackedForest(input_ids, position_ids, _subtree_ends(paths, packed), paths,
                        sum(s.shape[0] for s in sequences))


def _subtree_ends(paths: list[torch.Tensor], num_nodes: int) -> torch.Tensor:
    """Each node's subtree ends at the deepest node of the last (in DFS order) row through it."""
    ends = torch.arange(num_nodes)
    nonempty = [p for p in paths if p.numel()]
    if not nonempty:
        return ends
    nodes = torch.cat(nonempty)
    leaf = torch.cat([p[-1:].expand(p.shape[0]) for p in nonempty])
    return ends.scatter_reduce(0, nodes, leaf, reduce="amax")


def response_gather_index(forest: PackedForest, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every response token ``(row, col)``: the packed node whose output predicts it.

    Returns ``rows``, ``cols`` (into ``[B, Lr]``) and ``nodes`` (into the packed sequence): the
    node of the token just before ``(row, col)``, i.e. the prompt's last token for ``col == 0``.
    """
    lens = batch.response_lens
    rows = torch.repeat_interleave(torch.arange(batch.num_responses), lens)
    cols = torch.cat([torch.arange(int(n)) for n in lens]) if rows.numel() else rows
    prompt_lens = batch.prompt_lens[batch.prompt_index]
    nodes = torch.cat(
        [forest.row_paths[i][int(prompt_lens[i]) - 1 : int(prompt_lens[i]) - 1 + int(lens[i])]
         for i in range(batch.num_responses)]
    ) if rows.numel() else rows
    return rows, cols, nodes
