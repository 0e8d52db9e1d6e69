"""FCA: forest cascade attention for decode over a paged KV cache.

The entry point, for any engine (layouts in ``arctic_fca.fca.layout``)::

    step = prepare_decode(block_tables, seq_lens, block_size, num_q_heads=32, num_kv_heads=8,
                          head_dim=128, dtype=torch.bfloat16, device="cuda")   # once per decode step
    out = step(query, key_cache, value_cache, scale)                           # per layer

``prepare_decode`` does the host-side work once (the prefix forest, the cost model's choice of FCA
or plain decode, the Triton work items); the call runs the kernels (Triton on CUDA, the exact torch
path elsewhere). The pieces below it are exported for tests and for engines that plan on the
device (``device_work.DeviceWorkBuilder``, as the vLLM backend does).
"""

from arctic_fca.fca.cascade import fca_attention_with_lse, fca_decode_attention, merge_partials
from arctic_fca.fca.cost_model import ByteEstimate, CostConstants, choose, estimate_bytes
from arctic_fca.fca.decode import PreparedDecode, prepare_decode
from arctic_fca.fca.layout import SUPPORTED_DTYPES, DecodeShape, validate_decode_inputs
from arctic_fca.fca.plan import FCAPlan, build_plan
from arctic_fca.fca.reference import attention_with_lse, paged_attention_with_lse, paged_decode_attention

__all__ = [
    "SUPPORTED_DTYPES", "ByteEstimate", "CostConstants", "DecodeShape", "FCAPlan", "PreparedDecode",
    "attention_with_lse", "build_plan", "choose", "estimate_bytes", "fca_attention_with_lse", "fca_decode_attention",
    "merge_partials", "paged_attention_with_lse", "paged_decode_attention", "prepare_decode", "validate_decode_inputs",
]
