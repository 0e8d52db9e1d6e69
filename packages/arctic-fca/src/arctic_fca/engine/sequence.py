"""What the engine tracks per request: a prompt group waiting or being prefilled, a running sample,
and a finished sample as the engine returns it. A preempted sample waits as a group of one whose
prompt is its tokens so far: its prefill recomputes its K/V and draws its next token.

Every group and sample belongs to a request (``requests.GenerationRequest``): its settings, stop
tokens and seed; requests of many callers run in one batch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from arctic_core.config import SamplingParams

if TYPE_CHECKING:
    from arctic_fca.engine.requests import GenerationRequest

_sequence_ids = itertools.count()


@dataclass
class GenerationOutput:
    """One finished sample: its prompt's index in the call, the new tokens and their log-probs, the
    oldest policy version among its tokens and each token's own."""

    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    policy_version: int
    token_versions: list[int] = field(default_factory=list)


@dataclass
class PromptGroup:
    """A prompt and its samples-to-be, until its prefill forks them. Calls that ask for the same
    prompt with the same settings while it waits join it (``join``): the prompt is computed once
    for all their samples (a GRPO group sent as ``n`` calls of one sample is one group)."""

    prompt_index: int
    prompt: list[int]
    samples: int  # the request's n (every member's together), or 1 for a preempted sample
    request: GenerationRequest
    resumes: Sequence | None = None  # the preempted sample this group continues
    epoch: int = 0  # the engine's weights when it was admitted (its K/V are theirs)
    # (request, its prompt's index, samples) of each call the group serves, the first one's first
    members: list[tuple[GenerationRequest, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.members = self.members or [(self.request, self.prompt_index, self.samples)]

    def join(self, request: GenerationRequest, prompt_index: int) -> None:
        self.members.append((request, prompt_index, request.params.n))
        self.samples += request.params.n

    def keep(self, members: list[tuple[GenerationRequest, int, int]]) -> None:
        """Serve only ``members`` (the others were cancelled); at least one."""
        self.members = members
        self.request, self.prompt_index = members[0][:2]
        self.samples = sum(m[2] for m in members)

    def owner(self, sample: int) -> tuple[GenerationRequest, int, int]:
        """Whose the group's ``sample``-th sample is: (request, its prompt's index, its place among
        that request's samples of the prompt)."""
        for request, prompt_index, count in self.members:
            if sample < count:
                return request, prompt_index, sample
            sample -= count
        raise IndexError(f"the group has {self.samples} samples")

    def sample_key(self, sample: int) -> int:
        """The random numbers' key of the group's ``sample``-th sample (a preempted one keeps its own)."""
        if self.resumes is not None:
            return self.resumes.key
        request, prompt_index, place = self.owner(sample)
        return request.sample_key(prompt_index, place)
    blocks: list[int] = field(default_factory=list)  # the prompt's blocks, while it is prefilled
    cached: int = 0  # prompt tokens whose K/V another prompt already holds
    prefilled: int = 0  # prompt tokens whose K/V are in the cache (cached ones included)
    digests: list[int] | None = None  # chained hashes of the prompt's full blocks, once computed

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def new_tokens(self) -> int:
        """Tokens each sample may still draw."""
        return self.resumes.max_len - len(self.prompt) if self.resumes else self.params.max_tokens


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
    """One sample being decoded: prompt + tokens so far, and the KV blocks it reads (all of them
    from the fork when the scheduler reserves max_tokens, else taken as it grows)."""

    prompt_index: int
    tokens: list[int]
    max_len: int
    blocks: list[int]
    request: GenerationRequest
    key: int  # its random numbers' key (requests.sample_key)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that drew each new token
    epoch: int = 0  # the weights its K/V were computed with, if all of them were (else older)
    version_at_fork: int = 0
    digests: list[int] = field(default_factory=list)  # chained hashes of its first full blocks, as far as known
    done: bool = False
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))  # new when resumed: its blocks are new
    order: int = field(default_factory=lambda: next(_sequence_ids))  # the sample's place among its prompt's

    def preempt(self) -> None:
        """Its blocks are gone: the last token (whose K/V were never written) is drawn again after
        the recompute."""
        del self.tokens[-1], self.logprobs[-1], self.versions[-1]
        self.blocks = []
        self.seq_id = next(_sequence_ids)

    def append(self, token: int, logprob: float, version: int) -> None:
        """A new token drawn by policy ``version``; the sequence is done after one of its request's
        stop tokens or at its length limit."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.done = token in self.request.stops or len(self.tokens) >= self.max_len
