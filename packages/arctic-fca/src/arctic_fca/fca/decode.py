"""One decode step's attention, prepared once and called by every layer.

An engine builds a :class:`PreparedDecode` per decode step (the plan, the cost model's choice and,
for the Triton kernels, the work items: all host-side work happens here, once) and calls it with
each layer's query and KV cache. Kernels: Triton on CUDA (or under ``TRITON_INTERPRET=1``), the
exact torch path otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from arctic_fca.fca.cascade import fca_attention_with_lse
from arctic_fca.fca.cost_model import choose
from arctic_fca.fca.layout import SUPPORTED_DTYPES, check_block_size
from arctic_fca.fca.plan import FCAPlan, build_plan
from arctic_fca.fca.reference import plain_decode
from arctic_fca.fca.tuning import DEFAULT_TUNING, Tuning

if TYPE_CHECKING:
    from arctic_fca.fca.work import DecodeWork

Mode = Literal["auto", "fca", "plain"]
Kernel = Literal["auto", "triton", "torch"]


def default_kernel(device: torch.device) -> Literal["triton", "torch"]:
    return "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def resolve_kernel(kernel: Kernel, device: torch.device) -> Literal["triton", "torch"]:
    """The kernels that run: ``kernel``, or for "auto" the device's default."""
    return default_kernel(device) if kernel == "auto" else kernel


@dataclass
class PreparedDecode:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    plan: FCAPlan | None  # None: plain decode
    kernel: Literal["triton", "torch"]
    work: object | None = None  # triton work items

    @property
    def uses_fca(self) -> bool:
        return self.plan is not None

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """``query [requests, q_heads, head_dim]`` against the paged caches (layout as in
        ``arctic_fca.fca.layout``); returns the query dtype."""
        if self.kernel == "triton":
            from arctic_fca.fca.triton_decode import triton_decode_attention

            return triton_decode_attention(query, key_cache, value_cache, self.work, scale)
        if self.plan is None:
            out = plain_decode(query, key_cache, value_cache, self.block_tables, self.seq_lens, scale)
        else:
            out = fca_attention_with_lse(query, key_cache, value_cache, self.block_tables, scale, self.plan)[0]
        return out.to(query.dtype)


def choose_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, *, mode: Mode,
                num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                plan: FCAPlan | None = None) -> FCAPlan | None:
    """The FCA plan to run with (host tensors), or None for plain decode."""
    if mode == "plain":
        return None
    plan = plan.for_seq_lens(seq_lens) if plan is not None else build_plan(block_tables, seq_lens, block_size)
    if mode == "auto" and choose(plan, num_q_heads, num_kv_heads, head_dim, dtype) == "plain":
        return None
    return plan


def prepare_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, *, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, dtype: torch.dtype, mode: Mode = "auto",
                   kernel: Kernel = "auto", device: torch.device | str | None = None,
                   plan: FCAPlan | None = None, tuning: Tuning = DEFAULT_TUNING,
                   work: DecodeWork | None = None) -> PreparedDecode:
    """Plan one decode step from the host copies of ``block_tables`` / ``seq_lens`` (int32), for
    caches on ``device`` (default: where the tables are). ``mode``: "auto" lets the cost model pick
    FCA or plain; ``kernel``: "auto" picks Triton on CUDA and torch elsewhere. ``plan``: the tree of
    these tables when the caller already has it (an engine reuses it until a block fills up);
    ``tuning``: the Triton kernels' launch and split settings; ``work``: the Triton kernels' work
    items for this plan when the caller built them on the host (``arctic_fca.fca.work.build_work``)."""
    device = torch.device(device) if device is not None else block_tables.device
    block_tables, seq_lens = block_tables.cpu(), seq_lens.cpu()
    check_block_size(block_size)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"decode attention supports fp32/bf16/fp16, got {dtype}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    chosen_kernel = resolve_kernel(kernel, device)
    plan = choose_plan(block_tables, seq_lens, block_size, mode=mode, num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, plan=plan)
    tables_on_device = block_tables.to(device, non_blocking=True)
    prepared = PreparedDecode(tables_on_device, seq_lens.to(device, non_blocking=True), plan, chosen_kernel)
    if chosen_kernel == "triton":
        from arctic_fca.fca.work import plan_work, to_device

        prepared.work = (to_device(work, tables_on_device, num_q_heads, head_dim, tuning) if work is not None else
                         plan_work(plan, tables_on_device, seq_lens, block_size, num_q_heads, num_kv_heads, head_dim,
                                   tuning=tuning))
    elif plan is not None:
        prepared.plan = plan.to(device)
    return prepared
