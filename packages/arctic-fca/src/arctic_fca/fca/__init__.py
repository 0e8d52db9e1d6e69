"""FCA: forest cascade attention for decode over a paged KV cache (exact torch path).

Plain functions with documented tensor layouts (``layout``), so any engine can call them::

    plan = build_plan(block_tables, seq_lens, block_size)       # host side, once per step
    out = fca_or_plain_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, plan)
"""

from arctic_fca.fca.cascade import fca_attention_with_lse, fca_decode_attention, merge_partials
from arctic_fca.fca.cost_model import ByteEstimate, CostConstants, choose, estimate_bytes, fca_or_plain_decode
from arctic_fca.fca.layout import SUPPORTED_DTYPES, DecodeShape, validate_decode_inputs
from arctic_fca.fca.plan import FCAPlan, build_plan
from arctic_fca.fca.reference import attention_with_lse, paged_attention_with_lse, paged_decode_attention

__all__ = [
    "SUPPORTED_DTYPES", "ByteEstimate", "CostConstants", "DecodeShape", "FCAPlan", "attention_with_lse", "build_plan",
    "choose", "estimate_bytes", "fca_attention_with_lse", "fca_decode_attention", "fca_or_plain_decode",
    "merge_partials", "paged_attention_with_lse", "paged_decode_attention", "validate_decode_inputs",
]
