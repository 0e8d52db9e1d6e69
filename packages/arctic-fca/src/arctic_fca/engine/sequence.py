"""What the engine tracks per request: a prompt group waiting or being prefilled, a running sample,
and a finished sample as the engine returns it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_sequence_ids = itertools.count()


@dataclass
class GenerationOutput:
    """One finished sample: its prompt's index in the call, the new tokens and their log-probs."""

    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    policy_version: int


@dataclass
class PromptGroup:
    """A prompt and its ``n`` samples-to-be, until its prefill forks them."""

    prompt_index: int
    prompt: list[int]
    blocks: list[int] = field(default_factory=list)  # the prompt's blocks, while it is prefilled
    cached: int = 0  # prompt tokens whose K/V another prompt already holds
    prefilled: int = 0  # prompt tokens whose K/V are in the cache (cached ones included)


@dataclass(frozen=True)
class PrefillPiece:
    """Prompt positions ``start:end`` of ``group`` computed in one step (a chunk of its prompt)."""

    group: PromptGroup
    start: int
    end: int

    @property
    def completes(self) -> bool:
        """Whether the prompt's last token is in this piece: its logits start the ``n`` samples."""
        return self.end == len(self.group.prompt)


@dataclass
class Sequence:
    """One sample being decoded: prompt + tokens so far, and the KV blocks it reads (its blocks
    are fixed at admission, so a running sequence never waits for memory)."""

    prompt_index: int
    tokens: list[int]
    max_len: int
    blocks: list[int]
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))

    def append(self, token: int, logprob: float, stops: set[int]) -> None:
        """A new token; the sequence is done after a stop token or at its length limit."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.done = token in stops or len(self.tokens) >= self.max_len
