"""Built-in post-forward processors: per-token log-probs and entropy at a sampling temperature.

They run on logits gathered at response positions only (``[N, V]``), in float32, and keep the
autograd graph so that losses can differentiate through them.

On a GPU each runs compiled by ``torch.compile`` from the same expressions: eagerly, the upcast,
the maximum, the exponentials and the sums each pass over the ``[N, V]`` logits (152k columns for
Qwen3), about a sixth of a GRPO micro-batch on the H200; compiled, log-probs and entropy of a
2048-token chunk take 4.6 ms forward and backward instead of 21.2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from arctic_core.compiling import compiled
from arctic_core.errors import RequestError


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def log_probs_at(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    z = _scaled(logits, temperature)
    picked = z.gather(-1, targets[:, None]).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def entropy_of(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = _scaled(logits, temperature)
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)


def fused(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *args: object) -> torch.Tensor:
    """``fn(logits, *args)``: compiled for CUDA logits, eager elsewhere (where compiling does not pay)."""
    return (compiled(fn) if logits.is_cuda else fn)(logits, *args)


def _check_temperature(temperature: float) -> float:
    if temperature <= 0:
        raise RequestError(f"processor temperature must be > 0, got {temperature} (greedy has no log-probs)")
    return float(temperature)


class LogProbs:
    """log softmax(logits / temperature) at the target tokens."""

    outputs = ("logprobs",)

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = _check_temperature(temperature)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logprobs": fused(log_probs_at, logits, targets, self.temperature)}


class Entropy:
    """Entropy of softmax(logits / temperature), with its gradient."""

    outputs = ("entropy",)

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = _check_temperature(temperature)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"entropy": fused(entropy_of, logits, self.temperature)}
