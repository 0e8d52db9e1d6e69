"""Tensor layouts of decode attention over a paged KV cache, and their validation.

One decode step attends one new query token per request to everything that request has cached
(including the current token, whose K/V the caller wrote into the cache first):

==============  ===============================================  ==========================
tensor          shape                                            dtype
==============  ===============================================  ==========================
query           ``[num_requests, num_q_heads, head_dim]``         fp32 / bf16 / fp16
key_cache       ``[num_blocks, block_size, num_kv_heads, head_dim]``  same as query
value_cache     same as key_cache                                 same as query
block_tables    ``[num_requests, max_blocks_per_request]``        int32
seq_lens        ``[num_requests]``                                int32
==============  ===============================================  ==========================

Request ``r`` owns tokens ``0 .. seq_lens[r] - 1``; token ``t`` lives in block
``block_tables[r, t // block_size]`` at slot ``t % block_size``. Entries of a block-table row past
``ceil(seq_lens[r] / block_size)`` are padding and are never read (any value is allowed there).
GQA: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``; MHA is the case of
equal head counts. ``block_size`` is a power of two >= 16 (a Triton kernel tiles blocks in
powers of two; 16 is the smallest tile a tensor-core dot accepts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_BLOCK_SIZE = 16


@dataclass(frozen=True)
class DecodeShape:
    """The sizes a validated decode batch agreed on."""

    num_requests: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    max_blocks_per_request: int


def _check_dims(name: str, tensor: torch.Tensor, dims: str) -> None:
    expected = len(dims.split(","))
    if tensor.dim() != expected:
        raise ValueError(f"{name} must be [{dims}] ({expected} dims), got shape {tuple(tensor.shape)}")


def check_block_size(block_size: int) -> None:
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= {MIN_BLOCK_SIZE}, got {block_size}")


def validate_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                          num_blocks: int | None = None) -> None:
    """Check the paging metadata, values included (this reads ``seq_lens`` on the host)."""
    check_block_size(block_size)
    _check_dims("block_tables", block_tables, "num_requests, max_blocks_per_request")
    _check_dims("seq_lens", seq_lens, "num_requests")
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if tensor.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {tensor.dtype}")
    if seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} requests but block_tables has {block_tables.shape[0]}")
    if seq_lens.numel() == 0:
        return
    lens = seq_lens.cpu()
    if int(lens.min()) < 1:
        raise ValueError(f"seq_lens must be >= 1 (the current token is in the cache), got min {int(lens.min())}")
    capacity = block_tables.shape[1] * block_size
    if int(lens.max()) > capacity:
        bad = int(lens.argmax())
        raise ValueError(f"seq_lens[{bad}] = {int(lens[bad])} exceeds the {block_tables.shape[1]} blocks of "
                         f"block_tables (capacity {capacity} tokens at block_size {block_size})")
    if num_blocks is not None:
        _check_used_block_ids(block_tables.cpu(), lens, block_size, num_blocks)


def _check_used_block_ids(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
    used = torch.arange(block_tables.shape[1]) < ((lens + block_size - 1) // block_size)[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) within the requests' lengths "
                         f"(min {int(ids.min())}, max {int(ids.max())})")


def validate_decode_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor) -> DecodeShape:
    """Check every tensor of a decode batch against the layout above; return the agreed sizes."""
    _check_dims("query", query, "num_requests, num_q_heads, head_dim")
    _check_dims("key_cache", key_cache, "num_blocks, block_size, num_kv_heads, head_dim")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}")
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype must be one of fp32/bf16/fp16, got {tensor.dtype}")
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} dtype {tensor.dtype} differs from query dtype {query.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_requests, num_q_heads, q_head_dim = query.shape
    if q_head_dim != head_dim:
        raise ValueError(f"query head_dim {q_head_dim} != key_cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.dim() >= 1 and block_tables.shape[0] != num_requests:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but query has {num_requests} requests")
    validate_block_tables(block_tables, seq_lens, block_size, num_blocks)
    return DecodeShape(num_requests, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
                       block_tables.shape[1])
