"""Per batch: is FCA or plain paged decode faster? Decode attention is bound by memory traffic,
so both are priced in bytes moved, with fixed costs converted to bytes at the copy bandwidth.

plain = every request's seq_len tokens of K and V.
fca   = each shared node's tokens once + every suffix (the unique KV bytes), plus the partial
        results written and read back by the merge, plus fixed overheads per call and per node.

The overhead constants lean pessimistic for FCA because FCA must never lose; on the H200
(``bench/fca_kernels.py``, kernels replayed from CUDA graphs, docs/benchmarks.md) the choice was
right in all 12 measured cases: never slower than the plain kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from arctic_fca.fca.plan import FCAPlan

PARTIAL_STATE_BYTES = 4  # partial outs and lses are fp32


@dataclass(frozen=True)
class CostConstants:
    # H200 device-to-device copy, measured (docs/benchmarks.md): converts seconds to bytes.
    bandwidth_bytes_per_s: float = 4.3e12
    # FCA launches at least a node pass and a merge on top of the suffix pass: ~2 launches plus
    # their sync-free gaps. Assumed 4 us.
    per_call_overhead_s: float = 4e-6
    # Each node's pass ends in a split-K reduction and a partly idle last wave. Assumed 1 us.
    per_node_overhead_s: float = 1e-6
    # Choose FCA only if predicted at least this much faster: cost errors must not make it lose.
    min_speedup: float = 1.05


DEFAULT_COSTS = CostConstants()


@dataclass(frozen=True)
class ByteEstimate:
    plain: float
    fca: float
    unique_kv: float  # the KV bytes FCA reads (what its achieved bandwidth is measured on)
    fca_wins: bool  # the cost model's choice (``price``)


def token_bytes(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one KV token (K and V), and of one partial row (out [heads, d] + lse [heads] in
    fp32, written by its pass and read back by the merge)."""
    kv = 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return kv, 2 * num_q_heads * (head_dim + 1) * PARTIAL_STATE_BYTES


def price(plain_tokens, unique_tokens, partial_rows, num_nodes, kv_token_bytes: int, partial_row_bytes: int,
          costs: CostConstants = DEFAULT_COSTS):
    """(plain bytes, FCA bytes, FCA wins). Plain arithmetic, so the host plan (ints) and the
    device work builder (tensors, no sync) price a batch with the same formula."""
    overhead_s = costs.per_call_overhead_s + num_nodes * costs.per_node_overhead_s
    plain = plain_tokens * kv_token_bytes
    fca = unique_tokens * kv_token_bytes + partial_rows * partial_row_bytes + overhead_s * costs.bandwidth_bytes_per_s
    # No node: FCA would be the plain pass plus a merge.
    return plain, fca, (num_nodes > 0) & (plain >= costs.min_speedup * fca)


def estimate_bytes(plan: FCAPlan, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   costs: CostConstants = DEFAULT_COSTS) -> ByteEstimate:
    kv_bytes, row_bytes = token_bytes(num_q_heads, num_kv_heads, head_dim, dtype)
    plain, fca, wins = price(plan.plain_kv_tokens(), plan.fca_kv_tokens(), plan.num_partial_rows, plan.num_nodes,
                             kv_bytes, row_bytes, costs)
    return ByteEstimate(plain=plain, fca=fca, unique_kv=plan.fca_kv_tokens() * kv_bytes, fca_wins=bool(wins))


def choose(plan: FCAPlan, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
           costs: CostConstants = DEFAULT_COSTS) -> Literal["fca", "plain"]:
    return "fca" if estimate_bytes(plan, num_q_heads, num_kv_heads, head_dim, dtype, costs).fca_wins else "plain"
