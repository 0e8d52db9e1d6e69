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
    """A decode step's work on the host; ``node`` is None for plain decode or a plan without nodes."""

    table_width: int
    node_kv: np.ndarray
    q_index: np.ndarray
    node: Launch | None
    single: Launch
    merge_indptr: np.ndarray
    merge_rows: np.ndarray

    @property
    def num_partial_rows(self) -> int:
        return self.merge_rows.size

    @property
    def one_item_per_request(self) -> bool:
        """Plain and unsplit: each item can write its request's final output directly."""
        return self.node is None and self.single.num_items == self.merge_indptr.size - 1


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


def _chunks(kv_start: np.ndarray, kv_len: np.ndarray, chunk: int, block_size: int,
            even: bool = False) -> tuple[np.ndarray, ...]:
    """Split each run (start block offset, tokens) into pieces of at most `chunk` tokens (``even``:
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
                num_kv_heads: int, num_sms: int, tuning: Tuning) -> dict[str, np.ndarray]:
    """Items of the nodes: tiles of ``per_tile`` requests over pieces of the node's blocks."""
    kv_indptr, q_indptr = plan.node_kv_indptr.numpy().astype(np.int64), plan.node_q_indptr.numpy().astype(np.int64)
    node_tokens = np.diff(kv_indptr) * block_size
    tiles = -(-np.diff(q_indptr) // per_tile)
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
               num_kv_heads: int, num_sms: int, chunk: int | None = None,
               tuning: Tuning = DEFAULT_TUNING) -> DecodeWork:
    """Work items for FCA (``plan`` given) or plain decode (``plan`` None) of one decode step.

    ``seq_lens``: the step's sequence lengths (host); ``table_width``: the row width of the block
    tables as laid out in kv_index. ``chunk`` (tokens, a multiple of ``block_size``) overrides the
    split length.
    """
    if chunk is not None and chunk % block_size:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block_size ({block_size})")
    num_requests = seq_lens.size
    requests = np.arange(num_requests)
    has_nodes = plan is not None and plan.num_nodes > 0
    node_kv = plan.node_kv_indices.numpy() if has_nodes else np.zeros(0, np.int32)
    node_q = plan.node_q_indices.numpy() if has_nodes else np.zeros(0, np.int32)
    suffix_start = (plan.suffix_block_start.numpy().astype(np.int64) if plan is not None
                    else np.zeros(num_requests, np.int64))
    suffix_len = seq_lens.astype(np.int64) - suffix_start * block_size
    per_tile = tuning.per_tile(group)

    columns = []
    if has_nodes:
        columns.append((_node_items(plan, num_requests * table_width, block_size, per_tile, chunk, num_kv_heads,
                                    num_sms, tuning), per_tile))
    own = suffix_len > 0
    single_chunk = chunk or chunk_tokens(int(suffix_len.sum()), num_kv_heads, num_sms, block_size, tuning)
    run, start, tokens = _chunks((requests * table_width + suffix_start)[own], suffix_len[own], single_chunk,
                                 block_size)
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
    )


def plan_work(plan: FCAPlan | None, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
              num_q_heads: int, num_kv_heads: int, head_dim: int, chunk: int | None = None,
              tuning: Tuning = DEFAULT_TUNING) -> DeviceWork:
    """The work items of one decode step (FCA with ``plan``, plain without) on the tables' device."""
    host = build_work(plan, seq_lens.cpu().numpy(), block_tables.shape[1], block_size,
                      group=num_q_heads // num_kv_heads, num_kv_heads=num_kv_heads,
                      num_sms=device_sms(block_tables.device), chunk=chunk, tuning=tuning)
    return to_device(host, block_tables, num_q_heads, head_dim, tuning)
