"""A generate call inside the engine: its prompts join the running batch at the engine's next
step, beside every other caller's; the caller waits on it (or cancels it).

Each sample draws its random numbers from a key of its own, made from the call's seed, its
prompt's index and its place among the prompt's samples, and each of its tokens from that key and
the token's position (``sampling.SEED_STRIDE``): a seeded call draws the same numbers alone or
inside any batch, and a preempted sample draws the token it lost again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from arctic_core.config import SamplingParams
from arctic_core.errors import RequestCancelled
from arctic_fca.engine.sampling import SEED_STRIDE
from arctic_fca.engine.sequence import GenerationOutput, Sequence

_MASK = 2**64 - 1
__all__ = ["GenerationRequest", "RequestCancelled", "sample_key", "token_seed"]


def _splitmix64(x: int) -> int:
    """One step of splitmix64 (a 64-bit mixer: nearby inputs give unrelated outputs)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def as_int64(value: int) -> int:
    """``value`` wrapped into int64's range (as torch's int64 arithmetic wraps)."""
    value &= _MASK
    return value - 2**64 if value >= 2**63 else value


def sample_key(seed: int, prompt_index: int, sample: int) -> int:
    """The key of sample ``sample`` of prompt ``prompt_index`` of a call seeded ``seed``."""
    return as_int64(_splitmix64(_splitmix64(_splitmix64(seed & _MASK) ^ prompt_index) ^ sample))


def token_seed(key: int, position: int) -> int:
    """The seed of the token a sample with ``key`` draws at ``position`` (its length before it)."""
    return as_int64(key + position * SEED_STRIDE)


class GenerationRequest:
    """One call's prompts, settings and finished samples; ``wait`` returns its outputs in
    prompt-major order (prompt 0's samples first)."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, seed: int, stops: set[int],
                 on_sample: Callable[[], None] | None = None) -> None:
        self.prompts, self.params, self.seed, self.stops = prompts, params, seed, stops
        # What a prompt group shares: calls of equal settings but for their seed and n join one group.
        self.settings = params.model_dump_json(exclude={"seed", "n"})
        self.on_sample = on_sample  # called as each sample finishes (a progress bar)
        self.finished: dict[int, list[Sequence]] = {}
        self.left = len(prompts) * params.n
        self.cancelled = False
        self.error: BaseException | None = None
        self._done = threading.Event()

    def sample_key(self, prompt_index: int, sample: int) -> int:
        return sample_key(self.seed, prompt_index, sample)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, sequence: Sequence) -> None:
        self.finished.setdefault(sequence.prompt_index, []).append(sequence)
        self.left -= 1
        if self.on_sample is not None:
            self.on_sample()
        if self.left == 0:
            self._done.set()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self._done.set()

    def wait(self, timeout: float | None = None) -> list[GenerationOutput]:
        """The outputs once every sample has finished; the engine's error if the request failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the generate request did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return [GenerationOutput(i, s.tokens[len(p):], s.logprobs, min(s.versions, default=s.version_at_fork),
                                 s.versions)
                for i, p in enumerate(self.prompts) for s in sorted(self.finished[i], key=lambda s: s.order)]
