"""Log-probs and entropy of logits rows, forward and backward, as one Triton kernel each way (GPU).

The processors read ``[N, V]`` logits at response positions (V = 151,936 for Qwen3), which are
far larger than anything else they touch: a row is read once forward and once backward here.
The forward keeps, per row, a running maximum ``m``, ``s = sum exp(z - m)`` and
``u = sum exp(z - m) (z - m)`` (``z = logits / temperature`` in fp32), rescaled whenever ``m``
grows, which give ``lse = m + log s``, the entropy ``log s - u / s`` and the mean
``E_p[z] = lse - entropy``; the target's log-prob is ``z[target] - lse``. The backward writes, per
element, ``(g_logp ([j = target] - p_j) - g_entropy p_j (z_j - E_p[z])) / temperature`` with
``p_j = exp(z_j - lse)``, rounded once to the logits' dtype as the eager upcast's backward does.

torch.compile's kernels for the same expressions read each row several times and materialise an
fp32 ``[N, V]`` scatter for the log-probs' backward (what that costs a GRPO micro-batch:
docs/design/zorro.md). Under ``TRITON_INTERPRET=1`` the kernels run on the CPU, which is how the
CPU test suite checks them against the eager expressions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries a program reads per step


@triton.jit
def _forward_kernel(logits_ptr, targets_ptr, logprobs_ptr, entropy_ptr, lse_ptr, mean_ptr, vocab, stride_row,
                    temperature, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    # Running statistics in base 2 (z2 = z * log2 e): m2, s = sum 2^(z2 - m2), u2 = sum 2^(z2 - m2) (z2 - m2);
    # natural units at the end (times ln 2).
    m2 = float("-inf")
    s = 0.0
    u2 = 0.0
    for start in range(0, vocab, BLOCK):
        index = start + cols
        ok = index < vocab
        z = tl.load(base + index, mask=ok, other=float("-inf")).to(tl.float32)
        if SCALED:
            z = z / temperature
        z2 = z * 1.4426950408889634
        m_new = tl.maximum(m2, tl.max(z2, 0))
        shift = tl.where(m2 == float("-inf"), 0.0, m2 - m_new)  # <= 0 (s and u2 are still 0 before the first step)
        rescale = tl.exp2(shift)
        d = tl.where(ok, z2 - m_new, 0.0)
        e = tl.where(ok, tl.exp2(d), 0.0)
        u2 = rescale * (u2 + s * shift) + tl.sum(e * d, 0)
        s = rescale * s + tl.sum(e, 0)
        m2 = m_new
    lse = (m2 + tl.log2(s)) * 0.6931471805599453
    entropy = (tl.log2(s) - u2 / s) * 0.6931471805599453
    target = tl.load(targets_ptr + row)
    valid = (target >= 0) & (target < vocab)
    picked = tl.load(base + target, mask=valid, other=float("nan")).to(tl.float32)
    if SCALED:
        picked = picked / temperature
    tl.store(logprobs_ptr + row, picked - lse)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)
    tl.store(mean_ptr + row, lse - entropy)


@triton.jit
def _backward_kernel(logits_ptr, targets_ptr, lse_ptr, mean_ptr, grad_logprobs_ptr, grad_entropy_ptr, grad_ptr,
                     vocab, stride_row, stride_grad, temperature, SCALED: tl.constexpr, LOGPROBS: tl.constexpr,
                     ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = index < vocab
    z = tl.load(logits_ptr + row * stride_row + index, mask=ok, other=0.0).to(tl.float32)
    if SCALED:
        z = z / temperature
    p = tl.exp(z - tl.load(lse_ptr + row))
    grad = tl.zeros([BLOCK], tl.float32)
    if LOGPROBS:
        g = tl.load(grad_logprobs_ptr + row)
        grad = tl.where(index == tl.load(targets_ptr + row), g, 0.0) - g * p
    if ENTROPY:
        grad -= tl.load(grad_entropy_ptr + row) * p * (z - tl.load(mean_ptr + row))
    if SCALED:
        grad = grad / temperature
    tl.store(grad_ptr + row * stride_grad + index, grad.to(grad_ptr.dtype.element_ty), mask=ok)


def _rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2 or tuple(targets.shape) != (logits.shape[0],):
        raise ValueError(f"token_stats takes logits [N, V] and targets [N], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    return logits if logits.stride(1) == 1 else logits.contiguous()


class TokenStats(torch.autograd.Function):
    """``(log_softmax(z)[target], entropy(softmax(z)))`` per row, ``z = logits / temperature`` in
    fp32; differentiable with respect to ``logits`` through either output."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        logits = _rows(logits, targets)
        rows, vocab = logits.shape
        targets = targets.to(device=logits.device, dtype=torch.int64).contiguous()
        logprobs, entropy, lse, mean = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(4))
        if rows:
            _forward_kernel[(rows,)](logits, targets, logprobs, entropy, lse, mean, vocab, logits.stride(0),
                                     temperature, SCALED=temperature != 1.0, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(logits, targets, lse, mean)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # an output the loss does not read gets no backward work
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, lse, mean = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None
        rows, vocab = logits.shape
        grad = torch.empty_like(logits)
        if rows:
            unused = lse  # a pointer for the gradient a launch does not read
            _backward_kernel[(rows, triton.cdiv(vocab, BLOCK))](
                logits, targets, lse, mean,
                unused if grad_logprobs is None else grad_logprobs.float().contiguous(),
                unused if grad_entropy is None else grad_entropy.float().contiguous(),
                grad, vocab, logits.stride(0), grad.stride(0), ctx.temperature, SCALED=ctx.temperature != 1.0,
                LOGPROBS=grad_logprobs is not None, ENTROPY=grad_entropy is not None, BLOCK=BLOCK, num_warps=8)
        return grad, None, None


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-prob of ``targets`` and entropy (fp32 ``[N]`` each) of ``softmax(logits / temperature)``."""
    return TokenStats.apply(logits, targets, float(temperature))
