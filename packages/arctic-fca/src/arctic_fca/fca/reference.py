"""Plain paged decode attention: every request reads its whole KV. The baseline and the test oracle.

Also the building blocks FCA reuses: softmax attention that returns the log-sum-exp of its scores
(so partial results over disjoint KV sets can be merged exactly), and the paged gather.
Everything is computed in fp32.
"""

from __future__ import annotations

import torch

from arctic_fca.fca.layout import validate_decode_inputs


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       kv_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over a (partial) KV set, in fp32.

    q ``[batch, num_kv_heads, queries, head_dim]`` (the query heads of one KV head grouped along
    ``queries``), k / v ``[batch, num_kv_heads, keys, head_dim]``; ``kv_lens [batch]`` keeps only the
    first ``kv_lens[b]`` keys of batch entry ``b`` (None: all). Returns out
    ``[batch, num_kv_heads, queries, head_dim]`` and lse ``[batch, num_kv_heads, queries]`` (natural
    log). An empty KV set gives out 0 and lse -inf: it then weighs nothing in a merge.
    """
    scores = (q.float() * scale) @ k.float().transpose(-1, -2)
    if kv_lens is not None:
        padding = torch.arange(k.shape[2], device=k.device) >= kv_lens.to(k.device)[:, None]
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is NaN: shift empty rows by 0 instead, so their probabilities are exactly 0.
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.exp(scores - shift[..., None]) @ v.float()
    return out, lse


def gather_paged_kv(cache: torch.Tensor, block_tables: torch.Tensor, start_blocks: torch.Tensor,
                    num_tokens: torch.Tensor) -> torch.Tensor:
    """Each request's tokens from block ``block_tables[r, start_blocks[r]]`` on, padded to the
    longest: ``[num_requests, max_tokens_rounded_up_to_blocks, num_kv_heads, head_dim]``.

    Padding slots hold arbitrary cached values; callers mask them with ``num_tokens``.
    """
    num_requests, table_width = block_tables.shape
    block_size = cache.shape[1]
    blocks_needed = (num_tokens.cpu() + block_size - 1) // block_size
    width = int(blocks_needed.max()) if num_requests else 0
    cols = start_blocks.to(block_tables.device)[:, None].long() + torch.arange(width, device=block_tables.device)
    in_use = torch.arange(width, device=block_tables.device) < blocks_needed.to(block_tables.device)[:, None]
    # Table padding may hold any value (even -1): read block 0 there instead; it is masked anyway.
    ids = torch.where(in_use, block_tables.gather(1, cols.clamp(max=table_width - 1)), 0)
    return cache[ids.long()].flatten(1, 2)


def paged_attention_with_lse(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_tables: torch.Tensor, start_blocks: torch.Tensor, num_tokens: torch.Tensor,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request ``r``: attention to the ``num_tokens[r]`` tokens starting at block
    ``block_tables[r, start_blocks[r]]``. fp32 out ``[num_requests, num_q_heads, head_dim]`` and
    lse ``[num_requests, num_q_heads]``. Inputs are assumed validated."""
    num_requests, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    q = query.reshape(num_requests, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    k, v = (gather_paged_kv(cache, block_tables, start_blocks, num_tokens).transpose(1, 2)
            for cache in (key_cache, value_cache))
    out, lse = attention_with_lse(q, k, v, scale, num_tokens)
    return out.reshape(num_requests, num_q_heads, head_dim), lse.reshape(num_requests, num_q_heads)


def plain_decode(query, key_cache, value_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """The plain computation on validated inputs (fp32 result)."""
    start = torch.zeros_like(seq_lens)
    return paged_attention_with_lse(query, key_cache, value_cache, block_tables, start, seq_lens, scale)[0]


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention where every request reads its whole KV (layouts: ``arctic_fca.fca.layout``).
    Returns ``[num_requests, num_q_heads, head_dim]`` in the query dtype."""
    validate_decode_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    return plain_decode(query, key_cache, value_cache, block_tables, seq_lens, scale).to(query.dtype)
