"""FCA (forest cascade attention) for decode, in exact torch: shared prefixes are read once.

For each shared node of the plan, ONE attention pass reads the node's blocks once for the queries
of all requests below it (``[requests_below * num_q_heads]`` query rows against the node's KV);
then one pass per request over its own suffix; then the partial results of every request are
merged with log-sum-exp weights. The same plan drives the GPU kernel later; this path is the
CPU implementation and its oracle-checked specification.
"""

from __future__ import annotations

import torch

from arctic_fca.fca.layout import validate_decode_inputs
from arctic_fca.fca.plan import FCAPlan, build_plan
from arctic_fca.fca.reference import attention_with_lse, paged_attention_with_lse


def node_attention_with_lse(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_ids: torch.Tensor, request_ids: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over a shared node: its blocks are gathered once and every query head of every
    request below it attends to them as one batch. fp32 out ``[len(request_ids), num_q_heads,
    head_dim]`` and lse ``[len(request_ids), num_q_heads]``."""
    num_rows = request_ids.numel()
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    # [rows, kv_heads, group, d] -> [1, kv_heads, rows * group, d]: one KV head serves all its
    # query heads of all requests below the node.
    q = query[request_ids].reshape(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)
    q = q.reshape(1, num_kv_heads, num_rows * group, head_dim)
    k, v = (cache[block_ids].flatten(0, 1).transpose(0, 1).unsqueeze(0) for cache in (key_cache, value_cache))
    out, lse = attention_with_lse(q, k, v, scale)
    out = out.reshape(num_kv_heads, num_rows, group, head_dim).transpose(0, 1).reshape(num_rows, num_q_heads, head_dim)
    lse = lse.reshape(num_kv_heads, num_rows, group).transpose(0, 1).reshape(num_rows, num_q_heads)
    return out, lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, row_request: torch.Tensor,
                   num_requests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attention results over disjoint KV sets: row ``i`` of ``outs [rows, heads, d]``
    / ``lses [rows, heads]`` belongs to request ``row_request[i]``. Returns the merged out and lse.

    out = sum_i exp(lse_i - m) * out_i / sum_i exp(lse_i - m), with m the request's largest lse.
    Empty parts (lse -inf) weigh exactly 0; m is finite because every request has >= 1 token.
    """
    index = row_request.long().to(outs.device)
    heads_index = index[:, None].expand_as(lses)
    largest = torch.full((num_requests, lses.shape[1]), float("-inf"), device=lses.device)
    largest = largest.scatter_reduce(0, heads_index, lses, reduce="amax")
    weights = torch.exp(lses - largest[index])
    total = torch.zeros_like(largest).index_add_(0, index, weights)
    out = torch.zeros(num_requests, *outs.shape[1:], device=outs.device).index_add_(0, index, weights[..., None] * outs)
    return out / total[..., None], largest + torch.log(total)


def fca_attention_with_lse(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, scale: float,
                           plan: FCAPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """FCA on validated inputs with a matching plan: fp32 out ``[num_requests, num_q_heads,
    head_dim]`` and lse ``[num_requests, num_q_heads]``."""
    device = query.device
    suffix_out, suffix_lse = paged_attention_with_lse(
        query, key_cache, value_cache, block_tables, plan.suffix_block_start, plan.suffix_lens, scale)
    if plan.num_nodes == 0:
        return suffix_out, suffix_lse  # nothing shared: the suffixes are the whole sequences
    kv_indices, q_indices = plan.node_kv_indices.to(device).long(), plan.node_q_indices.to(device).long()
    kv_indptr, q_indptr = plan.node_kv_indptr.tolist(), plan.node_q_indptr.tolist()
    node_parts = [node_attention_with_lse(query, key_cache, value_cache, kv_indices[kv_indptr[n]:kv_indptr[n + 1]],
                                          q_indices[q_indptr[n]:q_indptr[n + 1]], scale)
                  for n in range(plan.num_nodes)]
    # Partial rows in the plan's order: node rows (node_q_indices order), then one suffix row per request.
    outs = torch.cat([out for out, _ in node_parts] + [suffix_out])
    lses = torch.cat([lse for _, lse in node_parts] + [suffix_lse])
    row_request = torch.cat([q_indices, torch.arange(plan.num_requests, device=device)])
    return merge_partials(outs, lses, row_request, plan.num_requests)


def fca_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         plan: FCAPlan | None = None) -> torch.Tensor:
    """Decode attention reading each shared prefix once (layouts: ``arctic_fca.fca.layout``).

    ``plan`` (from ``build_plan(block_tables, seq_lens, block_size)``) can be built once per step
    and reused across layers; it must describe these block tables. Equals
    ``paged_decode_attention`` up to fp32 rounding. Returns the query dtype.
    """
    shape = validate_decode_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    plan = plan if plan is not None else build_plan(block_tables, seq_lens, shape.block_size)
    plan.check_matches(shape)
    return fca_attention_with_lse(query, key_cache, value_cache, block_tables, scale, plan)[0].to(query.dtype)
