"""Built-in post-forward processors: per-token log-probs and entropy at a sampling temperature.

They run on logits gathered at response positions only (``[N, V]``), in float32, and keep the
autograd graph so that losses can differentiate through them.
"""

from __future__ import annotations

import torch

from arctic_core.errors import RequestError


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise RequestError(f"processor temperature must be > 0, got {temperature} (greedy has no log-probs)")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


class LogProbs:
    """log softmax(logits / temperature) at the target tokens."""

    outputs = ("logprobs",)

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        z = _scaled(logits, self.temperature)
        picked = z.gather(-1, targets[:, None]).squeeze(-1)
        return {"logprobs": picked - torch.logsumexp(z, dim=-1)}


class Entropy:
    """Entropy of softmax(logits / temperature), with its gradient."""

    outputs = ("entropy",)

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        z = _scaled(logits, self.temperature)
        probs = torch.softmax(z, dim=-1)
        return {"entropy": torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)}
