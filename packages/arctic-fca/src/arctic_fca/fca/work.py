"""Work items: the FCA plan (or a plain decode batch) cut into kernel-sized pieces, on the host.

The Triton kernel is ONE partial-attention kernel: a work item is "these query rows attend to
these KV tokens", and the same kernel serves shared nodes (many requests, the node's blocks), own
suffixes (one request, the rest of its block table) and plain decode (one request, all of it).
Long KV runs are split (split-K, as FlashDecoding does) so a batch of few requests still fills
the GPU; every item writes one partial (out, lse) row per request it serves; a merge kernel
combines each request's rows with log-sum-exp weights.

Layout (int32; built with numpy on the host once per decode step, shared by all layers)::

    kv_index      block_tables.flatten() ++ node_kv_indices: the block ids every item reads through
                  (request r's table row starts at r * table_width; the nodes' blocks after all rows)
    q_index       node_q_indices ++ arange(num_requests): the request ids every item serves
    per launch (node items, then single-request items), per item:
      kv_start    offset into kv_index of the item's first block (token 0 of that block)
      kv_len      KV tokens the item reads (>= 1)
      q_start     offset into q_index of the item's first request
      q_count     requests it serves (<= requests_per_tile)
      out_row     partial row of its first request; the j-th is out_row + j
    merge_indptr  [num_requests + 1], merge_rows: each request's partial rows

The tables come first so that their offsets do not depend on the plan: a CUDA graph keeps them in a
static buffer and rewrites them only when the batch's sequences change.

``DeviceWork`` / ``DeviceLaunch`` hold the same items as device tensors, the form the kernels
read: ``plan_work`` builds them from a plan on the host (``to_device``), ``graph_work`` keeps them
in fixed buffers for CUDA graphs, ``device_work.DeviceWorkBuilder`` derives them on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from arctic_fca.fca.plan import FCAPlan
from arctic_fca.fca.tuning import DEFAULT_TUNING, Tuning


@dataclass(frozen=True)
class Launch:
    """One kernel launch's items (int32 columns)."""

    kv_start: np.ndarray
    kv_len: np.ndarray
    q_start: np.ndarray
    q_count: np.ndarray
    out_row: np.ndarray
    requests_per_tile: int

    @property
    def num_items(self) -> int:
        return self.kv_start.size


@dataclass(frozen=True)
class DecodeWork:
    """A decode step's work on the host; ``node`` is None for plain decode, a plan without nodes,
    or the grouped layout (one launch: ``single``, whose tiles hold several requests)."""

    table_width: int
    node_kv: np.ndarray
    q_index: np.ndarray
    node: Launch | None
    single: Launch
    merge_indptr: np.ndarray
    merge_rows: np.ndarray
    # The grouped layout: each ``node_kv`` page's owner (-1: every row of the item sees it, else the
    # index among the item's requests of the only one that does) and its valid tokens; and the
    # partial rows written, some of which (rows that saw nothing) the merge does not read.
    node_kv_owner: np.ndarray | None = None
    node_kv_valid: np.ndarray | None = None
    rows_written: int | None = None

    @property
    def num_partial_rows(self) -> int:
        return self.merge_rows.size if self.rows_written is None else self.rows_written

    @property
    def grouped(self) -> bool:
        return self.node_kv_owner is not None

    @property
    def one_item_per_request(self) -> bool:
        """Plain and unsplit: each item can write its request's final output directly."""
        return (self.node is None and self.single.requests_per_tile == 1
                and self.single.num_items == self.merge_indptr.size - 1)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill (a nominal 8 off CUDA, e.g. under the Triton interpreter)."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 8


def chunk_tokens(total_tokens: int, num_kv_heads: int, num_sms: int, block_size: int,
                 tuning: Tuning = DEFAULT_TUNING) -> int:
    """Split length: aim at ``tuning.items_per_sm`` items per SM over (items x KV heads), within the
    tuning's chunk range (enough items in flight to hide the latency of the paged gathers, few enough
    partials to merge)."""
    target_items = max(1, tuning.items_per_sm * num_sms // max(1, num_kv_heads))
    chunk = 1 << max(0, int(np.ceil(np.log2(max(1, total_tokens / target_items)))))
    return int(min(tuning.max_chunk_tokens, max(tuning.min_chunk_tokens, chunk, block_size)))


def _chunks(kv_start: np.ndarray, kv_len: np.ndarray, chunk: int | np.ndarray, block_size: int,
            even: bool = False) -> tuple[np.ndarray, ...]:
    """Split each run (start block offset, tokens) into pieces of at most `chunk` tokens (one for
    every run, or one per run; ``even``:
    as many pieces, of equal length in whole blocks); returns (run index, piece start block offset,
    piece tokens) per piece."""
    size = np.full(kv_len.shape, chunk, dtype=np.int64)
    if even:
        size = piece_tokens(kv_len, chunk, block_size)
    pieces = np.maximum(1, -(-kv_len // size))
    run = np.repeat(np.arange(kv_len.size), pieces)
    k = np.arange(run.size) - (np.cumsum(pieces) - pieces)[run]
    tokens = np.minimum(size[run], kv_len[run] - k * size[run])
    return run, kv_start[run] + k * (size[run] // block_size), tokens


def piece_tokens(kv_len, chunk, block_size: int):
    """Each run's piece length when cut into ``ceil(len / chunk)`` pieces of equal length, rounded up
    to whole blocks (never above ``chunk``, itself whole blocks); numpy arrays or tensors."""
    pieces = _ceil_div(kv_len, chunk).clip(1)
    return (_ceil_div(_ceil_div(kv_len, pieces), block_size) * block_size).clip(block_size)


def _ceil_div(a, b):
    return -(-a // b)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + c)`` for each (s, c)."""
    return np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))


def _int32(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int32)


def _node_items(plan: FCAPlan, kv_base: int, block_size: int, per_tile: int, chunk: int | None,
                num_kv_heads: int, num_sms: int, tuning: Tuning,
                nodes: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Items of the nodes (those where ``nodes`` is True, all without it): tiles of ``per_tile``
    requests over pieces of the node's blocks."""
    kv_indptr, q_indptr = plan.node_kv_indptr.numpy().astype(np.int64), plan.node_q_indptr.numpy().astype(np.int64)
    node_tokens = np.diff(kv_indptr) * block_size
    tiles = -(-np.diff(q_indptr) // per_tile) * (1 if nodes is None else nodes)
    # Each launch is sized on its own work: the node launch must fill the GPU by itself.
    chunk = chunk or chunk_tokens(int((node_tokens * tiles).sum()), num_kv_heads, num_sms, block_size, tuning)
    run, start, tokens = _chunks(kv_base + kv_indptr[:-1], node_tokens, chunk, block_size, tuning.even_pieces)
    # Tiles of one piece are adjacent: they read the same KV, the later ones from L2.
    piece = np.repeat(np.arange(run.size), tiles[run])
    tile = np.arange(piece.size) - (np.cumsum(tiles[run]) - tiles[run])[piece]
    node = run[piece]
    q_first = q_indptr[node] + tile * per_tile
    return {"kv_start": start[piece], "kv_len": tokens[piece], "q_start": q_first,
            "q_count": np.minimum(per_tile, q_indptr[node + 1] - q_first)}


def build_work(plan: FCAPlan | None, seq_lens: np.ndarray, table_width: int, block_size: int, *, group: int,
               num_kv_heads: int, num_sms: int, chunk: int | None = None, tuning: Tuning = DEFAULT_TUNING,
               tables: np.ndarray | None = None) -> DecodeWork:
    """Work items for FCA (``plan`` given) or plain decode (``plan`` None) of one decode step.

    ``seq_lens``: the step's sequence lengths (host); ``table_width``: the row width of the block
    tables as laid out in kv_index. ``chunk`` (tokens, a multiple of ``block_size``) overrides the
    split length. ``tables`` (the block tables on the host): FCA then takes the grouped layout where
    ``tuning.own_tokens_in_tiles`` asks for it (:func:`_grouped_work`).
    """
    if chunk is not None and chunk % block_size:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block_size ({block_size})")
    if plan is not None and plan.num_nodes and tables is not None and tuning.own_tokens_in_tiles:
        return _grouped_work(plan, seq_lens, tables, block_size, tuning.per_tile(group), chunk, num_kv_heads, num_sms,
                             tuning)
    num_requests = seq_lens.size
    requests = np.arange(num_requests)
    has_nodes = plan is not None and plan.num_nodes > 0
    node_kv = plan.node_kv_indices.numpy() if has_nodes else np.zeros(0, np.int32)
    node_q = plan.node_q_indices.numpy() if has_nodes else np.zeros(0, np.int32)
    suffix_start = plan.suffix_block_start.numpy().astype(np.int64) if plan is not None else np.zeros(num_requests, np.int64)
    suffix_len = seq_lens.astype(np.int64) - suffix_start * block_size
    per_tile = tuning.per_tile(group)

    columns = []
    if has_nodes:
        columns.append((_node_items(plan, num_requests * table_width, block_size, per_tile, chunk, num_kv_heads,
                                    num_sms, tuning), per_tile))
    own = suffix_len > 0
    single_chunk = chunk or chunk_tokens(int(suffix_len.sum()), num_kv_heads, num_sms, block_size, tuning)
    run, start, tokens = _chunks((requests * table_width + suffix_start)[own], suffix_len[own], single_chunk, block_size)
    columns.append(({"kv_start": start, "kv_len": tokens, "q_start": node_q.size + requests[own][run],
                     "q_count": np.ones_like(run)}, 1))

    q_index = np.concatenate([node_q, requests])
    launches, row_request, next_row = [], [], 0
    for cols, requests_per_tile in columns:
        out_row = next_row + np.cumsum(cols["q_count"]) - cols["q_count"]
        next_row += int(cols["q_count"].sum())
        row_request.append(q_index[_ranges(cols["q_start"], cols["q_count"])])
        launches.append(Launch(**{k: _int32(v) for k, v in cols.items()}, out_row=_int32(out_row),
                               requests_per_tile=requests_per_tile))
    row_request_all = np.concatenate(row_request)
    counts = np.bincount(row_request_all, minlength=num_requests)
    return DecodeWork(
        table_width=table_width,
        node_kv=_int32(node_kv),
        q_index=_int32(q_index),
        node=launches[0] if has_nodes else None,
        single=launches[-1],
        merge_indptr=_int32(np.concatenate([[0], np.cumsum(counts)])),
        merge_rows=_int32(np.argsort(row_request_all, kind="stable")),
    )


# Valid tokens of a page read whole (a shared node's, or one reached through the block tables).
ALL_VALID = np.iinfo(np.int32).max


@dataclass(frozen=True)
class _Groups:
    """Tiles of the childless nodes' requests ("groups"), and the run of pages each group reads: its
    node's, then each member's own; the runs laid end to end ("regions")."""

    count: np.ndarray  # members per group
    first_member: np.ndarray  # each group's first, in members
    shared: np.ndarray  # pages of its node
    pages: np.ndarray  # pages of its run
    base: np.ndarray  # offset of its run in the regions
    members: np.ndarray  # requests, group by group
    own_pages: np.ndarray  # per member
    own_first: np.ndarray  # per member: offset of its own pages in the regions
    ids: np.ndarray  # the regions' block ids,
    owner: np.ndarray  # owners (-1: the node's page; else the member's index in its group)
    valid: np.ndarray  # and valid tokens


def _groups(plan: FCAPlan, childless: np.ndarray, lens: np.ndarray, tables: np.ndarray, bs: int,
            per_tile: int) -> _Groups:
    kv_indptr, q_indptr = plan.node_kv_indptr.numpy().astype(np.int64), plan.node_q_indptr.numpy().astype(np.int64)
    suffix_start = plan.suffix_block_start.numpy().astype(np.int64)
    tiles = np.where(childless, -(-np.diff(q_indptr) // per_tile), 0)
    node = np.repeat(np.arange(childless.size), tiles)
    first = q_indptr[node] + (np.arange(node.size) - (np.cumsum(tiles) - tiles)[node]) * per_tile
    count = np.minimum(per_tile, q_indptr[node + 1] - first)
    shared = np.diff(kv_indptr)[node]
    members = plan.node_q_indices.numpy().astype(np.int64)[_ranges(first, count)]
    group_of = np.repeat(np.arange(node.size), count)
    first_member = np.cumsum(count) - count
    own_pages = -(-lens[members] // bs) - suffix_start[members]  # 0 when every token is shared
    own_before = np.cumsum(own_pages) - own_pages
    pages = shared + np.bincount(group_of, weights=own_pages, minlength=node.size).astype(np.int64)
    base = np.cumsum(pages) - pages
    own_first = (base + shared)[group_of] + own_before - own_before[first_member[group_of]]

    ids = np.empty(int(pages.sum()), dtype=np.int32)
    owner = np.full(ids.size, -1, dtype=np.int32)
    valid = np.full(ids.size, ALL_VALID, dtype=np.int32)
    ids[_ranges(base, shared)] = plan.node_kv_indices.numpy()[_ranges(kv_indptr[node], shared)]
    own = _ranges(own_first, own_pages)
    member = np.repeat(np.arange(members.size), own_pages)
    column = suffix_start[members][member] + np.arange(own.size) - own_before[member]
    ids[own] = tables[members[member], column]
    owner[own] = (np.arange(members.size) - first_member[group_of])[member]
    valid[own] = np.minimum(bs, lens[members][member] - column * bs)
    return _Groups(count, first_member, shared, pages, base, members, own_pages, own_first, ids, owner, valid)


def _rows_seen(groups: _Groups, run: np.ndarray, start: np.ndarray, tokens: np.ndarray, out_row: np.ndarray,
               region_base: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """The partial rows of the group items (``run``: each item's group; ``start``: its first page in
    kv_index; ``out_row``: its first row) that the merge reads, with their requests: a member's row
    where the item holds a page it sees (its node's, or its own)."""
    item = np.repeat(np.arange(run.size), groups.count[run])
    j = np.arange(item.size) - (np.cumsum(groups.count[run]) - groups.count[run])[item]
    group, member = run[item], groups.first_member[run[item]] + j
    lo = start[item]
    hi = lo + -(-tokens[item] // bs)
    shared_lo = region_base + groups.base[group]
    own_lo = region_base + groups.own_first[member]
    own_hi = own_lo + groups.own_pages[member]
    sees_shared = (lo < shared_lo + groups.shared[group]) & (shared_lo < hi)
    sees = sees_shared | ((lo < own_hi) & (own_lo < hi) & (own_lo < own_hi))  # (no own pages: sees none)
    return (out_row[item] + j)[sees], groups.members[member][sees]


def _share_pieces(tokens: np.ndarray, work_tokens: int, target: int, bs: int) -> np.ndarray:
    """Per run of ``tokens``: the piece length (whole blocks) that cuts it into as many equal pieces
    as its share of ``target`` items over the step's ``work_tokens`` (at least one)."""
    pieces = np.maximum(1, np.rint(target * tokens / max(1, work_tokens))).astype(np.int64)
    return np.maximum(1, -(-tokens // (pieces * bs))) * bs


def _grouped_work(plan: FCAPlan, seq_lens: np.ndarray, tables: np.ndarray, block_size: int, per_tile: int,
                  chunk: int | None, num_kv_heads: int, num_sms: int, tuning: Tuning) -> DecodeWork:
    """The grouped layout: one launch, whose items take a tile of requests each. A node with no child
    (every request below it goes on with its own tokens: a GRPO prompt and its samples) is read
    together with its requests' own pages by the same query tile, each own page visible to the rows
    of its request only (``node_kv_owner``); its pages and theirs are copied after the nodes' blocks
    into ``node_kv``, one region per tile. Other nodes get the usual node items, and a request below
    no such node reads its own tokens alone. Against a shared-prompt launch and a launch of
    one-request items side by side, the step reads the same bytes in fewer, longer items."""
    num_requests, table_width = tables.shape
    bs = block_size
    kv_indptr, q_indptr = plan.node_kv_indptr.numpy().astype(np.int64), plan.node_q_indptr.numpy().astype(np.int64)
    node_q, node_kv = plan.node_q_indices.numpy().astype(np.int64), plan.node_kv_indices.numpy()
    parent = plan.node_parent.numpy()
    suffix_start, lens = plan.suffix_block_start.numpy().astype(np.int64), seq_lens.astype(np.int64)
    childless = np.ones(parent.size, dtype=bool)
    childless[parent[parent >= 0]] = False
    inner = ~childless
    groups = _groups(plan, childless, lens, tables, bs, per_tile)
    loose = np.ones(num_requests, dtype=bool)
    loose[groups.members] = False
    loose_requests = np.flatnonzero(loose)
    loose_len = lens[loose] - suffix_start[loose] * bs
    nodes_base, region_base = num_requests * table_width, num_requests * table_width + node_kv.size

    work_tokens = (int((np.diff(kv_indptr) * bs * -(-np.diff(q_indptr) // per_tile))[inner].sum())
                   + int(groups.pages.sum()) * bs + int(loose_len.sum()))
    if chunk is None:
        # Each run (a group's, or a loose request's own tokens) in as many equal pieces (whole blocks)
        # as its share of the step's work of the items the launch aims at (H100, a 4096-token prompt
        # and 8 x 256 own tokens: 4 pieces 77.0 us per layer, 3 pieces, the power-of-two split
        # length's, 83.8). Loose requests too: a prompt left with one sample is read alone, and a
        # split length sized for the whole step made it one long item that the launch waited for.
        target = max(1, tuning.items_per_sm * num_sms // num_kv_heads)
        group_chunk = _share_pieces(groups.pages * bs, work_tokens, target, bs)
        loose_chunk = _share_pieces(loose_len, work_tokens, target, bs)
    else:
        group_chunk = piece_tokens(groups.pages * bs, chunk, bs) if tuning.even_pieces else chunk
        loose_chunk = chunk
    chunk = chunk or chunk_tokens(work_tokens, num_kv_heads, num_sms, bs, tuning)

    inner_items = _node_items(plan, nodes_base, bs, per_tile, chunk, num_kv_heads, num_sms, tuning, nodes=inner)
    run, start, tokens = _chunks(region_base + groups.base, groups.pages * bs, group_chunk, bs)
    loose_run, loose_start, loose_tokens = _chunks(loose_requests * table_width + suffix_start[loose], loose_len,
                                                   loose_chunk, bs)
    q_index = np.concatenate([node_q, groups.members, np.arange(num_requests)])
    cols = {"kv_start": np.concatenate([inner_items["kv_start"], start, loose_start]),
            "kv_len": np.concatenate([inner_items["kv_len"], tokens, loose_tokens]),
            "q_start": np.concatenate([inner_items["q_start"], node_q.size + groups.first_member[run],
                                       node_q.size + groups.members.size + loose_requests[loose_run]]),
            "q_count": np.concatenate([inner_items["q_count"], groups.count[run], np.ones_like(loose_run)])}
    out_row = np.cumsum(cols["q_count"]) - cols["q_count"]

    # Partial rows the merge reads: every row of a node item and of a request's own item; a group
    # item's rows only for requests that see one of its pages.
    n_inner = inner_items["kv_start"].size
    group_rows, group_requests = _rows_seen(groups, run, start, tokens, out_row[n_inner:], region_base, bs)
    rows = np.concatenate([_ranges(out_row[:n_inner], cols["q_count"][:n_inner]), group_rows,
                           out_row[n_inner + run.size:]])
    requests = np.concatenate([q_index[_ranges(cols["q_start"][:n_inner], cols["q_count"][:n_inner])],
                               group_requests, loose_requests[loose_run]])
    # The tile: a power of two (its rows are one anyway), so that groups thinning out as samples
    # finish do not ask the engine for a CUDA graph per group size.
    tile = per_tile if inner.any() else min(per_tile, 1 << (int(groups.count.max()) - 1).bit_length())
    return DecodeWork(
        table_width=table_width,
        node_kv=_int32(np.concatenate([node_kv, groups.ids])),
        q_index=_int32(q_index),
        node=None,
        single=Launch(**{k: _int32(v) for k, v in cols.items()}, out_row=_int32(out_row), requests_per_tile=tile),
        merge_indptr=_int32(np.concatenate([[0], np.cumsum(np.bincount(requests, minlength=num_requests))])),
        merge_rows=_int32(rows[np.argsort(requests, kind="stable")]),
        node_kv_owner=_int32(np.concatenate([np.full(node_kv.size, -1), groups.owner])),
        node_kv_valid=_int32(np.concatenate([np.full(node_kv.size, ALL_VALID), groups.valid])),
        rows_written=int(cols["q_count"].sum()),
    )


# ----------------------------------------------------------------- the same work on the device

ITEM_COLUMNS = ("kv_start", "kv_len", "q_start", "q_count", "out_row")


@dataclass
class DeviceLaunch:
    items: torch.Tensor  # [5, capacity] int32: ITEM_COLUMNS
    count: torch.Tensor  # [1] int32: items in use this step (the grid covers the capacity)
    requests_per_tile: int


@dataclass
class DeviceWork:
    """A step's work items on the device (``work.DecodeWork`` with the block tables in front)."""

    kv_index: torch.Tensor
    q_index: torch.Tensor
    node: DeviceLaunch | None
    single: DeviceLaunch
    merge_indptr: torch.Tensor
    merge_rows: torch.Tensor
    partial: torch.Tensor  # [rows, q_heads, head_dim] fp32
    lse: torch.Tensor  # [rows, q_heads] fp32
    direct: bool  # one unsplit item per request: no partials, no merge
    tuning: Tuning = DEFAULT_TUNING  # the settings the items were cut for, and the launches use
    # The grouped layout (``DecodeWork.grouped``): each kv_index entry's owner and valid tokens.
    kv_owner: torch.Tensor | None = None
    kv_valid: torch.Tensor | None = None


def item_columns(launch: Launch) -> np.ndarray:
    """A launch's items as the [5, items] int32 array the kernels read (ITEM_COLUMNS)."""
    return np.stack([getattr(launch, c) for c in ITEM_COLUMNS]) if launch.num_items else np.zeros((5, 1), np.int32)


def to_device(work: DecodeWork, block_tables: torch.Tensor, num_q_heads: int, head_dim: int,
              tuning: Tuning = DEFAULT_TUNING) -> DeviceWork:
    """Exactly sized device copies of ``work`` (``block_tables``: the device tables it was built for)."""
    device = block_tables.device

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)).to(device, non_blocking=True)

    def launch(host: Launch) -> DeviceLaunch:
        return DeviceLaunch(tensor(item_columns(host)), tensor(np.array([host.num_items])), host.requests_per_tile)

    rows = max(1, work.num_partial_rows)
    table_entries = block_tables.numel()
    return DeviceWork(
        kv_index=torch.cat([block_tables.reshape(-1).to(torch.int32), tensor(work.node_kv)]),
        q_index=tensor(work.q_index),
        node=launch(work.node) if work.node is not None else None,
        single=launch(work.single),
        merge_indptr=tensor(work.merge_indptr),
        merge_rows=tensor(work.merge_rows),
        partial=torch.empty(rows, num_q_heads, head_dim, dtype=torch.float32, device=device),
        lse=torch.empty(rows, num_q_heads, dtype=torch.float32, device=device),
        direct=work.one_item_per_request,
        tuning=tuning,
        kv_owner=tensor(np.concatenate([np.full(table_entries, -1), work.node_kv_owner])) if work.grouped else None,
        kv_valid=(tensor(np.concatenate([np.full(table_entries, ALL_VALID), work.node_kv_valid])) if work.grouped
                  else None),
    )


def plan_work(plan: FCAPlan | None, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
              num_q_heads: int, num_kv_heads: int, head_dim: int, chunk: int | None = None,
              tuning: Tuning = DEFAULT_TUNING) -> DeviceWork:
    """The work items of one decode step (FCA with ``plan``, plain without) on the tables' device."""
    # The tables come back to the host (a copy from the device, a sync) only for the grouped layout.
    grouped = plan is not None and tuning.own_tokens_in_tiles
    host = build_work(plan, seq_lens.cpu().numpy(), block_tables.shape[1], block_size,
                      group=num_q_heads // num_kv_heads, num_kv_heads=num_kv_heads,
                      num_sms=device_sms(block_tables.device), chunk=chunk, tuning=tuning,
                      tables=block_tables.cpu().numpy() if grouped else None)
    return to_device(host, block_tables, num_q_heads, head_dim, tuning)
