"""GPU check of the training rotary embedding: the Triton kernel (``arctic_zorro.rotary_kernel``)
against transformers' expression in fp32 and the torch.compile'd one, forward and backward, on q/k
of a ~9,500-token micro-batch (Qwen3-1.7B heads) as the projections write them (token-major), with
the gradients arriving token-major as they do from the attention; and each one's kernel time.

    python3 bench/rotary_check.py
"""
import json

import torch
from torch.profiler import ProfilerActivity, profile

from arctic_core.compiling import compiled
from arctic_zorro.fused_elementwise import _rotary_on_tokens, rotary, token_major_rotary
from arctic_zorro.rotary_kernel import TritonRotary

T, H, KV, D = 9534, 16, 8, 128


def fwd_bwd(fn, q, k, cos, sin, gq, gk) -> list[torch.Tensor]:
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    out = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.autograd.backward(out, (gq, gk))
    return [*out, q.grad, k.grad]


def kernel_us(fn, *args) -> float:
    """Device time of one forward and backward (the kernels and any copies they need)."""
    fwd_bwd(fn, *args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fwd_bwd(fn, *args)
        torch.cuda.synchronize()
    return round(sum(e.device_time_total for e in prof.key_averages()) / 5, 1)


def main() -> None:
    variants = {"triton": TritonRotary.apply, "compiled token-major": compiled_token_major,
                "compiled head-major (before)": compiled(rotary)}
    report = {}
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(1, T, h, D, device="cuda", generator=gen) for h in (H, KV))
        angle = torch.rand(1, T, D // 2, device="cuda", generator=gen) * 100
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        gq, gk = (torch.randn(1, T, h, D, device="cuda", generator=gen).transpose(1, 2) for h in (H, KV))
        exact = [t.detach() for t in fwd_bwd(rotary, q, k, cos, sin, gq, gk)]  # transformers' expression in fp32
        half = [t.to(dtype) for t in (q, k, cos, sin, gq, gk)]
        for name, fn in variants.items():
            got = fwd_bwd(fn, *half)
            error = [round(float((g.float() - e).abs().max()), 4) for g, e in zip(got, exact, strict=True)]
            report[f"{dtype} {name}"] = {"max_abs_err_vs_fp32 (q, k, dq, dk)": error, "kernel_us": kernel_us(fn, *half)}
            print(json.dumps({f"{dtype} {name}": report[f"{dtype} {name}"]}), flush=True)
    q, k = (t.to(torch.bfloat16).requires_grad_() for t in (q, k))
    taken = token_major_rotary(q.transpose(1, 2), k.transpose(1, 2), cos.bfloat16(), sin.bfloat16())[0].grad_fn
    print("compile_elementwise's rotary on the GPU in bf16 runs:", type(taken).__name__, flush=True)


def compiled_token_major(q, k, cos, sin):
    """The compiled expression on [B, T, H, D], as ``token_major_rotary`` runs it off the kernel's path."""
    q, k = compiled(_rotary_on_tokens)(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2)


if __name__ == "__main__":
    main()
