"""The log-prob and entropy processors' Triton kernels against the compiled expressions (GPU).

One LM-head chunk of a GRPO micro-batch (2,048 response tokens x Qwen3's 151,936-entry vocabulary,
bf16 logits): device time of the processors' forward (log-probs and entropy, as TRL's adapter
asks for both) and of forward + backward through the log-probs (what the policy loss
differentiates), and each path's largest error against the expressions in fp64. --smoke runs the
kernels on the CPU under ``TRITON_INTERPRET=1``. The last line is a JSON object of all results.
"""

from __future__ import annotations

import argparse
import json

import torch

from arctic_core.compiling import compiled
from arctic_core.losses import processors
from arctic_core.losses.token_stats import token_stats
from fca_common import smoke_or_gpu, time_us


def kernel_path(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    return token_stats(logits, targets, temperature)[0], token_stats(logits, targets, temperature)[1]


def compiled_path(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (compiled(processors.log_probs_at)(logits, targets, temperature),
            compiled(processors.entropy_of)(logits, temperature))


PATHS = {"kernels": kernel_path, "compiled": compiled_path}


def errors(rows: int, vocab: int, temperature: float, device: str, dtype: torch.dtype,
           paths: tuple[str, ...] = tuple(PATHS)) -> dict[str, dict[str, float]]:
    """Each path's largest log-prob / entropy / gradient error against fp64 (the gradient's
    relative to its largest value; the loss: a random weighting of the log-probs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(rows, vocab, generator=gen, device=device)).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    weights = torch.randn(rows, generator=gen, device=device, dtype=torch.float64)
    reference = logits.double().requires_grad_()
    z = reference / temperature
    lse = torch.logsumexp(z, -1)
    ref_logp, ref_entropy = z.gather(-1, targets[:, None])[:, 0] - lse, lse - (torch.softmax(z, -1) * z).sum(-1)
    (ref_logp @ weights).backward()
    out = {}
    for name in paths:
        path = PATHS[name]
        leaf = logits.clone().requires_grad_()
        logp, entropy = path(leaf, targets, temperature)
        (logp.double() @ weights).backward()
        out[name] = {"logprobs": float((logp.double() - ref_logp).abs().max()),
                     "entropy": float((entropy.double() - ref_entropy).abs().max()),
                     "grad_rel": float((leaf.grad.double() - reference.grad).abs().max() / reference.grad.abs().max())}
    return out


def timings(rows: int, vocab: int) -> dict[str, dict[str, float]]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = (3 * torch.randn(rows, vocab, generator=gen, device="cuda")).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
    weights = torch.randn(rows, generator=gen, device="cuda")
    out = {}
    for name, path in PATHS.items():

        def forward(p=path):
            with torch.no_grad():
                p(logits, targets, 1.0)

        def forward_backward(p=path):
            logp, _ = p(logits, targets, 1.0)
            torch.autograd.grad(logp @ weights, logits)

        out[name] = {"forward_us": time_us(forward), "forward_backward_us": time_us(forward_backward)}
    bytes_read = logits.numel() * logits.element_size()
    out["one_read_of_the_logits_us"] = bytes_read / (4.3e12 / 1e6)  # at the copy rate measured on the H200
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU exactness check (run with TRITON_INTERPRET=1)")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    args = parser.parse_args()
    if smoke_or_gpu(args.smoke, lambda: {"kernels_vs_fp64": errors(6, 9000, 0.7, "cpu", torch.float32, ("kernels",))},
                    "token_stats.py"):
        return
    results = {"errors_bf16": errors(256, args.vocab, 1.0, "cuda", torch.bfloat16),
               "errors_fp32_t0.7": errors(256, args.vocab, 0.7, "cuda", torch.float32),
               "timings": timings(args.rows, args.vocab)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
