"""FCA work items built on the device from the block tables alone: no host sync, fixed shapes.

``work.build_work`` builds a step's items on the host from an ``FCAPlan``, which needs the block
tables and sequence lengths on the host. An engine that keeps them only on the device (vLLM's
model runner) would pay a device-to-host sync per step to use it. ``DeviceWorkBuilder`` derives
the same forest with tensor operations on the tables' device and writes the items into buffers
allocated once, so the Triton kernels (``triton_decode``) read them unchanged, in or out of a
CUDA graph. Every size is a capacity fixed at construction; counts live in device tensors.

How the forest is found without walking it: prefix caching hands out physical blocks so that one
block id means one token prefix (a block's identity chains over its parents). So

- a block read by ``c >= 2`` requests is shared by exactly those ``c``; along a request's row the
  counts never grow, and a **node** is a maximal run of columns with the same count;
- the node's requests are the holders of its first block, and its blocks are read through the
  table row of its lowest-numbered holder (its **leader**), so no block ids are copied.

The builder checks that property on the device (every block has one column and one parent block
for all its holders); a batch that breaks it, that the cost model prices plain, or whose
(node, request) pairs exceed the capacity, runs as plain decode with the same kernels: the choice
is a tensor, never a host branch.

Capacities (``DeviceWorkBuilder.caps``; R requests, tables W wide, ``target`` items per launch):
node items <= target + R*W*bs/max_chunk + pairs, single items <= target + R + R*W*bs/max_chunk,
node rows <= per_tile * target + R*W*bs/max_chunk + pairs. They hold by construction: the split
length is never below (work / target), so no batch overflows them; only the (node, request) pairs
are checked (a forest deeper than ``PAIRS_PER_REQUEST`` nodes decodes plain).

On CUDA each batch size's build is captured in a CUDA graph once and replayed: eager, its ~250
small ops cost more host time per step than a short decode step can hide. Replayed, they still
cost GPU time (one small kernel after another; fusing them with ``torch.compile`` measured no
faster in the vLLM engine; figures in docs/design/fca.md). Two cheaper builds serve callers that
know more than the tables:

- ``build(shared=False)``: no block is shared; the plain work from one Triton program on CUDA
  (``plain_work``; ``plain_kernel=False``: ~55 torch ops, as on the CPU).
- ``build(forest_key=k)`` a second time with the same ``k``: the same requests in the same rows,
  grown by decode steps only. Their forest cannot have changed (blocks a request fills while it
  decodes are its own), so the last full build's nodes, pairs and suffix starts are kept and only
  the single items and the merge are written, without a sort (~40 ops). Every ``REFRESH_BUILDS``
  such builds a full one runs again, so the cost model sees the grown suffixes.

Each (batch size, build) pair has graphs of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Literal

import torch

from arctic_fca.fca.cost_model import DEFAULT_COSTS, CostConstants, price, token_bytes
from arctic_fca.fca.plain_work import write_plain_work
from arctic_fca.fca.work import DeviceLaunch, DeviceWork
from arctic_fca.fca.tuning import DEFAULT_TUNING, Tuning
from arctic_fca.fca.work import device_sms, piece_tokens

logger = logging.getLogger(__name__)
PAIRS_PER_REQUEST = 4  # (node, request) pairs per request the buffers hold: a forest four nodes deep
REFRESH_BUILDS = 64  # builds that reuse one forest before the next full build re-prices it
Build = Literal["forest", "reuse", "plain"]  # the full search, a kept forest, nothing shared


class DeviceWorkBuilder:
    """Persistent buffers for the work of a batch of up to ``max_requests`` decode requests whose
    block tables are ``table_width`` wide, over a KV cache of ``num_blocks`` blocks."""

    def __init__(self, max_requests: int, table_width: int, num_blocks: int, block_size: int, *, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, device: torch.device | str,
                 costs: CostConstants = DEFAULT_COSTS, num_sms: int | None = None,
                 tuning: Tuning = DEFAULT_TUNING, chunk_range: tuple[int, int] | None = None, graphs: bool = True,
                 plain_kernel: bool | None = None) -> None:
        device = torch.device(device)
        # The plain build as one Triton program (``plain_work``) instead of ~55 torch ops: on CUDA
        # by default (faster per replayed build, bit-equal work: ``bench/fca_device_work.py
        # --plain-cost``, docs/design/fca.md); elsewhere Triton runs only under its interpreter.
        self.plain_kernel = device.type == "cuda" if plain_kernel is None else plain_kernel
        # Static shapes per batch size: on CUDA each (size, build) pair is captured once and replayed.
        self.graphs: dict[tuple[int, Build], torch.cuda.CUDAGraph] | None = (
            {} if graphs and device.type == "cuda" else None)
        self._pool = None
        low, high = chunk_range or (tuning.min_chunk_tokens, tuning.max_chunk_tokens)
        self.chunk_range = (max(low, block_size), high)  # split lengths allowed
        self.tuning = tuning
        self.max_requests, self.width = max_requests, table_width
        self.num_blocks, self.block_size = num_blocks, block_size
        self.group = num_q_heads // num_kv_heads
        self.per_tile = tuning.per_tile(self.group)
        self.target = max(1, tuning.items_per_sm * (num_sms or device_sms(device)) // num_kv_heads)
        self.kv_token_bytes, self.partial_row_bytes = token_bytes(num_q_heads, num_kv_heads, head_dim, kv_dtype)
        self.costs = costs
        self.max_pairs = PAIRS_PER_REQUEST * max_requests
        long_pieces = max_requests * table_width * block_size // self.chunk_range[1] + 1
        self.caps = {"node_items": self.target + long_pieces + self.max_pairs,
                     "single_items": self.target + long_pieces + max_requests,
                     "node_rows": self.per_tile * self.target + long_pieces + self.max_pairs}
        self.caps["rows"] = self.caps["node_rows"] + self.caps["single_items"]

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        # The step's inputs are copied here; the kernels read the block tables through this very
        # buffer (row r starts at r * table_width), so no second copy is made for them.
        self.tables_in, self.lens_in = ints(max_requests, table_width), ints(max_requests)
        self.work = DeviceWork(
            kv_index=self.tables_in.view(-1),
            q_index=ints(self.max_pairs + max_requests),
            node=DeviceLaunch(ints(5, self.caps["node_items"]), ints(1), self.per_tile),
            single=DeviceLaunch(ints(5, self.caps["single_items"]), ints(1), 1),
            merge_indptr=ints(max_requests + 1),
            merge_rows=ints(self.caps["rows"]),
            partial=torch.zeros(self.caps["rows"], num_q_heads, head_dim, dtype=torch.float32, device=device),
            lse=torch.zeros(self.caps["rows"], num_q_heads, dtype=torch.float32, device=device),
            direct=False,
            tuning=tuning,
        )
        self.used_fca = torch.zeros((), dtype=torch.bool, device=device)  # this step's choice, for metrics
        # What a full build keeps for the builds that reuse its forest (``forest_key``): each
        # request's first unshared block, its node rows in merge order, and the node rows' count.
        self.kept = {"suffix_start": ints(max_requests), "node_count": ints(max_requests),
                     "node_merge_rows": ints(self.caps["node_rows"]), "node_rows": ints(1)}
        self.kept_key: Hashable | None = None  # the forest_key of the kept forest; None: none kept
        self.reuses = 0  # builds since the kept forest was searched
        self.builds = {"forest": 0, "reuse": 0, "plain": 0}  # host-side counts, for metrics
        if self.plain_kernel and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            # Compile the Triton program now, with the engine: its first JIT inside the first step
            # that shares nothing stalls that step, a visible share of a run's throughput in vLLM.
            self._build_plain(1)

    def build(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, *, shared: bool = True,
              forest_key: Hashable | None = None) -> DeviceWork:
        """This step's items (``block_tables [R, table_width]`` int32 and ``seq_lens [R]`` on the
        builder's device, R <= max_requests; a request of length 0 is padding and gets no output).

        ``shared=False``: the caller knows that no two requests share a block (an engine that
        keeps the tables on the host too can tell at no cost). The forest is then not looked for:
        every request is read whole, the work the full build writes when it chooses plain, for a
        tenth of its kernels (a batch that shares nothing must not pay for FCA).

        ``forest_key``: names this batch's requests, row by row (the engine's request identities);
        the same key as the last full build's means the same requests, only longer, and their
        forest is reused (see the module docstring)."""
        num_requests, width = block_tables.shape
        if num_requests > self.max_requests or width != self.width:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} exceed the builder's capacity "
                             f"({self.max_requests} requests, width {self.width})")
        self.tables_in[:num_requests].copy_(block_tables)
        self.lens_in[:num_requests].copy_(seq_lens)
        kind = self._choose(shared, None if forest_key is None else (forest_key, num_requests))
        self.builds[kind] += 1
        if self.graphs is None:
            self._build(num_requests, kind)
            return self.work
        # Batch sizes round up to a power of two (rows of length 0 are padding, given no work), so
        # an engine that does not pad its batches still needs only ~log2(max_requests) graphs.
        bucket = min(self.max_requests, 1 << max(0, num_requests - 1).bit_length())
        self.lens_in[num_requests:bucket].zero_()
        graph = self.graphs.get((bucket, kind))
        if graph is None:
            try:
                graph = self._capture(bucket, kind)
            except RuntimeError as error:  # e.g. a capture already running on this stream
                logger.warning("FCA work builder: CUDA graph capture failed (%s); building eagerly from now on", error)
                self.graphs = None
                self._build(num_requests, kind)
                return self.work
        graph.replay()
        return self.work

    def _choose(self, shared: bool, key: Hashable | None) -> Build:
        """Which build this step needs (``key``: the caller's forest key and the batch size, or
        None); what is kept for reuse follows from it."""
        if not shared:
            self.kept_key = None
            return "plain"
        if key is not None and key == self.kept_key and self.reuses < REFRESH_BUILDS:
            self.reuses += 1
            return "reuse"
        self.kept_key, self.reuses = key, 0
        return "forest"

    def _capture(self, num_requests: int, kind: Build) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()  # warm up off the capturing stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._build(num_requests, kind)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for every batch size: a build's temporaries die with it.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._build(num_requests, kind)
        self._pool = graph.pool()
        self.graphs[num_requests, kind] = graph
        return graph

    def _build(self, num_requests: int, kind: Build) -> None:
        """The work of the first ``num_requests`` rows of the input buffers."""
        if kind == "plain":
            return self._build_plain(num_requests)
        if kind == "reuse":
            return self._build_reusing_forest(num_requests)
        tables, lens = self.tables_in[:num_requests].long(), self.lens_in[:num_requests].long()
        forest = _Forest(tables, lens, self.block_size, self.num_blocks)
        fca = forest.consistent & self._fca_pays(forest) & (forest.num_pairs <= forest.pair_slots)
        forest.keep_if(fca)
        self.used_fca.copy_(fca)
        self.work.q_index[: forest.pair_slots].copy_(forest.pair_request)
        node_rows = self._node_items(forest)
        pieces = self._single_items(forest.suffix_start, forest.suffix_len, node_rows)
        self._merge(forest, node_rows)
        self._keep_forest(forest.suffix_start, pieces, node_rows)

    def _keep_forest(self, suffix_start: torch.Tensor, pieces: torch.Tensor, node_rows: torch.Tensor) -> None:
        """Keep what ``_build_reusing_forest`` needs. A request's merge entries are its node rows,
        then its single rows (rows sort stably, and node rows come first)."""
        num_requests, kept = suffix_start.numel(), self.kept
        indptr = self.work.merge_indptr[: num_requests + 1].long()
        node_count = indptr.diff() - pieces
        _, owner, j, _ = _expand(node_count, self.caps["node_rows"])
        entry = (indptr[owner] + j).clamp(max=self.caps["rows"] - 1)  # slots past the total: unread
        kept["node_merge_rows"].copy_(self.work.merge_rows[entry])
        kept["node_count"][:num_requests].copy_(node_count)
        kept["suffix_start"][:num_requests].copy_(suffix_start)
        kept["node_rows"].copy_(node_rows.reshape(1))

    def _build_reusing_forest(self, num_requests: int) -> None:
        """The kept forest's node items and pairs stand; each request's suffix has grown, so its
        single items and the merge are written anew. The merge needs no sort: request r's entries
        are its kept node rows, then its new single rows, which ``_single_items`` numbers
        consecutively from ``node_rows`` in request order."""
        kept, lens = self.kept, self.lens_in[:num_requests].long()
        suffix_start, node_count = kept["suffix_start"][:num_requests].long(), kept["node_count"][:num_requests].long()
        node_rows = kept["node_rows"].long().reshape(())
        suffix = (lens - suffix_start * self.block_size).clamp(min=0)
        pieces = self._single_items(suffix_start, suffix, node_rows)
        counts = node_count + pieces
        slot, owner, j, total = _expand(counts, self.caps["rows"])
        from_node = j < node_count[owner]
        node_entry = (_indptr(node_count)[owner] + j).clamp(max=self.caps["node_rows"] - 1)
        single_row = node_rows + (pieces.cumsum(0) - pieces)[owner] + j - node_count[owner]
        rows = torch.where(from_node, kept["node_merge_rows"].long()[node_entry], single_row)
        self.work.merge_rows.copy_(torch.where(slot < total, rows, 0))
        self.work.merge_indptr[: num_requests + 1].copy_(_indptr(counts))

    def _build_plain(self, num_requests: int) -> None:
        """Every request read whole by the single launch: its rows are its items, in request order,
        so the merge needs no sort."""
        self.used_fca.zero_()
        if self.plain_kernel:
            return write_plain_work(self.work, self.lens_in, num_requests=num_requests, width=self.width,
                                    block_size=self.block_size, target=self.target, max_pairs=self.max_pairs,
                                    chunk_range=self.chunk_range, max_requests=self.max_requests)
        lens = self.lens_in[:num_requests].long()
        self.work.node.count.zero_()
        pieces = self._single_items(torch.zeros_like(lens), lens, lens.new_zeros(()))
        self.work.merge_rows.copy_(torch.arange(self.caps["rows"], device=lens.device))
        self.work.merge_indptr[: num_requests + 1].copy_(_indptr(pieces))

    def _fca_pays(self, forest: _Forest) -> torch.Tensor:
        """The cost model's choice, priced on tensors (``cost_model.price``)."""
        unique = forest.node_len.sum() * self.block_size + forest.suffix_len.sum()
        return price(forest.lens.sum(), unique, forest.num_pairs + forest.lens.numel(), forest.num_nodes,
                     self.kv_token_bytes, self.partial_row_bytes, self.costs)[2]

    # ---- items --------------------------------------------------------------------------------------

    def _chunk(self, work_tokens: torch.Tensor) -> torch.Tensor:
        """Split length (as ``work.chunk_tokens``): a power of two near total / target, clamped."""
        ratio = (work_tokens.double() / self.target).clamp(min=1.0)
        chunk = torch.exp2(torch.ceil(torch.log2(ratio))).long()
        return chunk.clamp(*self.chunk_range)

    def _node_items(self, forest: _Forest) -> torch.Tensor:
        """Fill the node launch; return the number of partial rows it writes."""
        bs, tokens = self.block_size, forest.node_len * self.block_size
        tiles = _ceil_div(forest.node_size, self.per_tile)
        size = self._chunk((tokens * tiles).sum()).expand(tokens.shape)
        if self.tuning.even_pieces:
            size = piece_tokens(tokens, size, bs)
        pieces = _ceil_div(tokens, size)
        item, owner, local, total = _expand(pieces * tiles, self.caps["node_items"])
        piece, tile = local // tiles[owner].clamp(min=1), local % tiles[owner].clamp(min=1)
        q_first = forest.node_q_start[owner] + tile * self.per_tile
        size = size[owner]
        columns = (forest.node_row[owner] * self.width + forest.node_col[owner] + piece * (size // bs),
                   torch.minimum(size, tokens[owner] - piece * size),
                   q_first,
                   torch.minimum(torch.full_like(q_first, self.per_tile),
                                 forest.node_size[owner] - tile * self.per_tile))
        return _write_launch(self.work.node, columns, item < total, first_row=tokens.new_zeros(()))

    def _single_items(self, suffix_start: torch.Tensor, suffix: torch.Tensor, node_rows: torch.Tensor) -> torch.Tensor:
        """Fill the single launch with each request's tokens from block ``suffix_start`` on
        (``suffix`` of them); return each request's number of items."""
        chunk = self._chunk(suffix.sum())
        pieces = _ceil_div(suffix, chunk)
        item, owner, piece, total = _expand(pieces, self.caps["single_items"])
        columns = (owner * self.width + suffix_start[owner] + piece * (chunk // self.block_size),
                   torch.minimum(chunk, suffix[owner] - piece * chunk),
                   self.max_pairs + owner,
                   torch.ones_like(owner))
        self.work.q_index[self.max_pairs : self.max_pairs + suffix.numel()].copy_(
            torch.arange(suffix.numel(), device=suffix.device))
        _write_launch(self.work.single, columns, item < total, first_row=node_rows)
        return pieces

    def _merge(self, forest: _Forest, node_rows: torch.Tensor) -> None:
        """Each request's partial rows, grouped by request (merge_indptr / merge_rows)."""
        work, num_requests = self.work, forest.lens.numel()
        sentinel = self.max_requests  # rows nobody reads sort last
        request = torch.full((self.caps["rows"],), sentinel, dtype=torch.long, device=work.lse.device)
        node, single = work.node.items.long(), work.single.items.long()
        # Node rows: row k belongs to item i with out_row[i] <= k < out_row[i] + q_count[i] (items
        # past the count have q_count 0, so they own no row).
        row, item, j, _ = _expand(node[3], self.caps["node_rows"])
        pair = (node[2, item] + j).clamp(max=work.q_index.numel() - 1)  # rows past the count: any valid index
        request[row] = torch.where(row < node_rows, work.q_index.long()[pair], sentinel)
        live = torch.arange(single.shape[1], device=request.device) < work.single.count[0]
        tail = torch.full((single.shape[1],), self.caps["rows"] - 1, dtype=torch.long, device=request.device)
        request.scatter_(0, torch.where(live, single[4], tail), torch.where(live, single[2] - self.max_pairs, sentinel))
        order = torch.sort(request.int(), stable=True)  # int32 keys: half the radix passes of int64
        work.merge_rows.copy_(order.indices)
        counts = torch.zeros(sentinel + 1, dtype=torch.long, device=request.device).scatter_add_(
            0, request, torch.ones_like(request))
        # Entry 0 too, every step: nothing may rest on a buffer's first contents (vLLM's sleep mode
        # can hand memory back with other bytes in it).
        work.merge_indptr[: num_requests + 1].copy_(_indptr(counts[:num_requests]))


class _Forest:
    """The shared-prefix forest of one batch, as per-request and per-node tensors (see the module
    docstring). Nodes are numbered by their leader's (row, column) in row-major order."""

    def __init__(self, tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
        rows, width = tables.shape
        device = tables.device
        self.lens, self.num_blocks, self.block_size = lens, num_blocks, block_size
        self.cols = torch.arange(width, device=device).expand(rows, width)
        self.rows = torch.arange(rows, device=device)[:, None].expand(rows, width)
        # Only full blocks can be shared. Every other entry gets a dummy id of its own past the
        # real ones (one shared dummy would serialise the scatters below on one address).
        valid = (self.cols < (lens // block_size)[:, None]) & (tables >= 0) & (tables < num_blocks)
        dummies = num_blocks + torch.arange(rows * width, device=device).view(rows, width)
        self.ids = torch.where(valid, tables, dummies)
        holders = self._per_block(torch.ones_like(self.ids), "sum", 0)
        holders[num_blocks:].zero_()  # a dummy is held by nobody (a slice: an int index would sync)
        self.count = holders[self.ids]
        parent = torch.cat([torch.full_like(tables[:, :1], -1), tables[:, :-1]], dim=1)
        self.consistent = ((self._agree(self.cols) & self._agree(parent)) | ~valid).all()
        self._find_nodes(self.count >= 2)

    def _per_block(self, values: torch.Tensor, reduce: str, initial: int) -> torch.Tensor:
        out = torch.full((self.num_blocks + self.ids.numel(),), initial, dtype=torch.long, device=values.device)
        return out.scatter_reduce_(0, self.ids.reshape(-1), values.reshape(-1), reduce)

    def _agree(self, values: torch.Tensor) -> torch.Tensor:
        """Whether every holder of each block sees the same value of ``values`` there."""
        big = torch.iinfo(torch.long).max
        return self._per_block(values, "amin", big)[self.ids] == self._per_block(values, "amax", -big)[self.ids]

    def keep_if(self, flag: torch.Tensor) -> None:
        """Drop every node unless ``flag`` (a device bool): the batch then decodes plain. Nodes of
        size 0 get no items and suffixes start at 0; the pairs are then never read."""
        self.node_len, self.node_size = torch.where(flag, self.node_len, 0), torch.where(flag, self.node_size, 0)
        self.node_q_start = self.node_size.cumsum(0) - self.node_size
        self.num_nodes, self.num_pairs = torch.where(flag, self.num_nodes, 0), torch.where(flag, self.num_pairs, 0)
        self.suffix_start = torch.where(flag, self.suffix_start, 0)
        self.suffix_len = (self.lens - self.suffix_start * self.block_size).clamp(min=0)

    def _find_nodes(self, shared: torch.Tensor) -> None:
        rows, width = shared.shape
        count = torch.where(shared, self.count, 0)
        before = torch.cat([torch.zeros_like(count[:, :1]), count[:, :-1]], dim=1)
        start = shared & (count != before)
        # A node runs from its start to the next column that starts another node or is not shared.
        boundary = torch.where(start | ~shared, self.cols, width)
        after = torch.cat([boundary[:, 1:], torch.full_like(boundary[:, :1], width)], dim=1)
        run_end = after.flip(1).cummin(1).values.flip(1)
        first_holder = self._per_block(torch.where(shared, self.rows, rows), "amin", rows)
        leader = start & (first_holder[self.ids] == self.rows)
        node_of_leader = leader.reshape(-1).cumsum(0) - 1
        self.num_nodes = leader.sum()
        self.num_pairs = start.sum()
        self.suffix_start = shared.sum(1)
        self.suffix_len = (self.lens - self.suffix_start * self.block_size).clamp(min=0)
        capacity = rows  # a forest whose nodes each branch has fewer nodes than leaves
        flat = torch.arange(rows * width, device=shared.device)
        slot = torch.where(leader.reshape(-1) & (node_of_leader < capacity), node_of_leader, capacity + flat)

        def per_node(values: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(capacity + flat.numel(), dtype=torch.long, device=values.device)
            return out.scatter_(0, slot, values.reshape(-1))[:capacity]

        self.node_row, self.node_col = per_node(self.rows), per_node(self.cols)
        self.node_len, self.node_size = per_node(run_end - self.cols), per_node(count)
        self.node_q_start = self.node_size.cumsum(0) - self.node_size
        # Pairs in node order, requests ascending within a node: sort keys node * rows + request.
        # Only the pairs are sorted (compacted in row-major order into PAIRS_PER_REQUEST slots per
        # request; a batch with more decodes plain anyway), as int32: a sort of the whole table
        # was the build's most expensive kernel.
        node_id = self._per_block(torch.where(leader, node_of_leader.reshape(rows, width), -1), "amax", -1)[self.ids]
        self.pair_slots = pair_slots = PAIRS_PER_REQUEST * rows
        position = start.reshape(-1).cumsum(0) - 1
        slot = torch.where(start.reshape(-1) & (position < pair_slots), position, pair_slots + flat)
        keys = torch.full((pair_slots + flat.numel(),), torch.iinfo(torch.int32).max, dtype=torch.int32,
                          device=shared.device)
        keys.scatter_(0, slot, (node_id * rows + self.rows).reshape(-1).int())
        self.pair_request = (torch.sort(keys[:pair_slots]).values % rows).long()


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    """Where each owner's entries start, and the end: ``[0, c0, c0 + c1, ...]``."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def _ceil_div(a: torch.Tensor, b: torch.Tensor | int) -> torch.Tensor:
    return (a + b - 1) // b


def _expand(counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, ...]:
    """Enumerate ``counts[o]`` entries per owner ``o`` into ``capacity`` slots, without a sync:
    (slot index, owner, index within the owner, total). Slots past the total are garbage that
    callers mask with ``slot < total``."""
    ends = counts.cumsum(0)
    slot = torch.arange(capacity, device=counts.device)
    owner = torch.searchsorted(ends, slot, right=True).clamp(max=max(0, counts.numel() - 1))
    return slot, owner, slot - (ends[owner] - counts[owner]), ends[-1] if counts.numel() else slot.new_zeros(())


def _write_launch(launch: DeviceLaunch, columns: tuple[torch.Tensor, ...], live: torch.Tensor,
                  first_row: torch.Tensor) -> torch.Tensor:
    """Write items (kv_start, kv_len, q_start, q_count) where ``live``, zeros elsewhere; number
    their partial rows from ``first_row``; return the rows they write."""
    q_count = torch.where(live, columns[3], 0)
    out_row = first_row + q_count.cumsum(0) - q_count
    launch.items.copy_(torch.where(live, torch.stack([*columns[:3], q_count, out_row]), 0))  # one write, not five
    launch.count.copy_(live.sum().reshape(1))
    return q_count.sum()
