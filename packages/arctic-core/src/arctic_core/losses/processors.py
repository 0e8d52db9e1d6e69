"""Built-in post-forward processors: per-token log-probs and entropy at a sampling temperature.

They run on logits gathered at response positions only (``[N, V]``), in float32, and keep the
autograd graph so that losses can differentiate through them.

On a GPU both run on one Triton kernel each way (:mod:`arctic_core.losses.token_stats`), which
reads the ``[N, V]`` logits (152k columns for Qwen3) once forward and once backward: eagerly, the
upcast, the maximum, the exponentials and the sums each pass over them, a sizeable share of a
GRPO micro-batch (docs/design/zorro.md). The kernel yields both outputs at once, so inside :func:`sharing` (the
training engines' processor loop) a loss reading both log-probs and entropy gets them from one
forward launch and, with gradients through both, one backward launch writing one ``[N, V]``
gradient instead of two that autograd then adds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

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


_KernelKey = tuple[int, int, int, int, float]
_shared_results: ContextVar[dict[_KernelKey, tuple] | None] = ContextVar("arctic_shared_token_stats", default=None)


@contextmanager
def sharing() -> Iterator[None]:
    """Within the block, processors called on the same logits, targets and temperature share one
    kernel launch each way; the results are dropped on exit (they hold the logits for the backward)."""
    token = _shared_results.set({})
    try:
        yield
    finally:
        _shared_results.reset(token)


def runs_on_kernel(logits: torch.Tensor) -> bool:
    """Where the processors take the Triton kernels: CUDA logits (the CPU keeps the expressions)."""
    return logits.is_cuda


def on_kernel(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of CUDA logits through the Triton kernels (imported where a GPU runs them)."""
    from arctic_core.losses.token_stats import token_stats

    shared = _shared_results.get()
    # The tensors' versions too: a processor that wrote into the logits in place gets fresh statistics.
    key = (id(logits), logits._version, id(targets), targets._version, temperature)
    if shared is not None and key in shared:
        return shared[key][2]
    stats = token_stats(logits, targets, temperature)
    if shared is not None:
        shared[key] = (logits, targets, stats)  # the inputs pinned: their ids stay theirs while the entry lives
    return stats


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
        if runs_on_kernel(logits):
            return {"logprobs": on_kernel(logits, targets, self.temperature)[0]}
        return {"logprobs": log_probs_at(logits, targets, self.temperature)}


class Entropy:
    """Entropy of softmax(logits / temperature), with its gradient."""

    outputs = ("entropy",)

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = _check_temperature(temperature)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        if runs_on_kernel(logits):
            return {"entropy": on_kernel(logits, targets, self.temperature)[1]}
        return {"entropy": entropy_of(logits, self.temperature)}
