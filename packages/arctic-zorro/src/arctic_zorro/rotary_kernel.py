"""The rotary embedding of a training forward as one Triton kernel each way (half precision on a GPU).

``apply_rotary_pos_emb`` of the Qwen/Llama/Mistral families rotates the two halves of each head:
``out1 = x1 * cos1 - x2 * sin1``, ``out2 = x2 * cos2 + x1 * sin2``. That map is linear in ``x``, so
its backward is the transposed rotation of the output gradient:
``dx1 = g1 * cos1 + g2 * sin2``, ``dx2 = g2 * cos2 - g1 * sin1``. Both run in fp32 and round once
into the input's dtype, as the compiled expression does.

torch.compile's kernel for the same expression moves its bytes well below the copy rate
(docs/design/zorro.md); this one reads each head's halves as ``[tokens, D/2]``
tiles and writes the result token-major (``[B, T, H, D]``), the layout the projections write q/k
in and FlexAttention's padding copies from.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 32


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, tokens,
                   x_stride_b, x_stride_h, x_stride_t, cs_stride_b, cs_stride_t,
                   out_stride_b, out_stride_h, out_stride_t,
                   HALF: tl.constexpr, BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr):
    block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = block * BLOCK + tl.arange(0, BLOCK)[:, None]
    d = tl.arange(0, HALF)[None, :]
    keep = t < tokens
    x = x_ptr + batch * x_stride_b + head * x_stride_h + t * x_stride_t + d
    cs = batch * cs_stride_b + t * cs_stride_t + d
    x1, x2 = tl.load(x, mask=keep).to(tl.float32), tl.load(x + HALF, mask=keep).to(tl.float32)
    cos1, cos2 = tl.load(cos_ptr + cs, mask=keep).to(tl.float32), tl.load(cos_ptr + cs + HALF, mask=keep).to(tl.float32)
    sin1, sin2 = tl.load(sin_ptr + cs, mask=keep).to(tl.float32), tl.load(sin_ptr + cs + HALF, mask=keep).to(tl.float32)
    if TRANSPOSED:
        out1, out2 = x1 * cos1 + x2 * sin2, x2 * cos2 - x1 * sin1
    else:
        out1, out2 = x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2
    out = out_ptr + batch * out_stride_b + head * out_stride_h + t * out_stride_t + d
    tl.store(out, out1.to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(out + HALF, out2.to(out_ptr.dtype.element_ty), mask=keep)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x [B, H, T, D]`` (any strides, the last dimension contiguous) rotated; the result is a
    ``[B, H, T, D]`` view of a token-major ``[B, T, H, D]`` tensor."""
    batch, heads, tokens, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(batch, tokens, heads, dim, dtype=x.dtype, device=x.device).transpose(1, 2)
    grid = (triton.cdiv(tokens, BLOCK_TOKENS), heads, batch)
    cos_stride_b = cos.stride(0) if cos.shape[0] > 1 else 0  # one set of positions for every row
    _rotary_kernel[grid](x, cos, sin, out, tokens, x.stride(0), x.stride(1), x.stride(2), cos_stride_b, cos.stride(1),
                         out.stride(0), out.stride(1), out.stride(2), HALF=dim // 2, BLOCK=BLOCK_TOKENS,
                         TRANSPOSED=transposed)
    return out


class TritonRotary(torch.autograd.Function):
    """``apply_rotary_pos_emb(query, key, cos, sin)`` for ``[B, H, T, D]`` q/k and ``[B, T, D]``
    cos/sin (no gradient flows to cos/sin: they are functions of the positions only)."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(query, cos, sin, False), _rotate(key, cos, sin, False)

    @staticmethod
    def backward(ctx, grad_query: torch.Tensor, grad_key: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad_query, cos, sin, True), _rotate(grad_key, cos, sin, True), None, None


def fits(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel covers these inputs: half precision on a GPU, a power-of-two head size,
    cos/sin per (batch, token) as transformers builds them, with no gradient of their own."""
    dim = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and key.dtype == query.dtype
            and cos.dtype == sin.dtype == query.dtype and not (cos.requires_grad or sin.requires_grad)
            and cos.shape == sin.shape and cos.dim() == 3 and cos.shape[0] in (1, query.shape[0])
            and cos.shape[1:] == (query.shape[2], dim) and dim >= 16 and dim & (dim - 1) == 0)
