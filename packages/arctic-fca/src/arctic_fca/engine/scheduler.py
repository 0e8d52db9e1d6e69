"""Admission and KV blocks: which prompt groups run next, the blocks they take, which of their
prompt tokens each prefill step computes, the fork of a prefilled prompt into its ``n`` samples, and
(when the cache runs out) which samples give their blocks back.

Two ways to lend blocks (``admission``):
- ``on_demand`` (vLLM's): a group is admitted when its prompt's blocks fit (those not already cached:
  the prefix index finds full blocks another prompt holds) with its samples' first blocks and a
  block of headroom per sample running; samples take blocks as they grow. When the running samples
  cannot all grow, the newest give theirs back (preempted) and wait first in line: their prefill
  recomputes their tokens so far (the prompt's blocks are usually still held by their siblings).
  Rollouts that stop early run many more samples at once than their max_tokens would allow.
- ``worst_case``: a group is admitted only when its samples' whole max_tokens fit too; those blocks
  are held in reserve until the fork takes them, so nothing is ever preempted.

Admitted prompts are computed first in, first out, ``max_prefill_tokens`` per step: a prompt whose
blocks another admitted prompt shares is therefore never computed before them.

Groups come from every caller's requests, each with its own settings (``group.params``). The
prefix index holds only blocks computed with the current weights (``epoch``): a sample that ran
across a weight update keeps its blocks to the end but never offers them to later prompts.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

from arctic_core.config import SamplingParams
from arctic_core.errors import RequestError
from arctic_fca.engine.blocks import BlockPool, block_hashes
from arctic_fca.engine.kv_cache import PagedKVCache
from arctic_fca.engine.sequence import PrefillPiece, PromptGroup, Sequence


Admission = Literal["on_demand", "worst_case"]


class Scheduler:
    def __init__(self, cache: PagedKVCache, block_size: int, max_num_seqs: int, max_prefill_tokens: int,
                 admission: Admission = "on_demand") -> None:
        self.cache, self.block_size, self.admission = cache, block_size, admission
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.pool = BlockPool(cache.num_blocks)
        self.reserved = 0  # free blocks promised to the samples of admitted groups not yet forked
        self.epoch = 0  # which weights the cache's K/V are computed with (a weight update moves it)

    def reset(self) -> None:
        """Every block back (after a failed step: every request in flight fails with it)."""
        self.pool, self.reserved = BlockPool(self.pool.num_blocks), 0

    def new_weights(self) -> None:
        """Cached prefixes hold K/V of the old weights: forget them, and index no block computed before."""
        self.pool.clear_index()
        self.epoch += 1

    @property
    def used_blocks(self) -> int:
        """Blocks held by admitted groups and running samples (idle cached ones are free)."""
        return self.pool.capacity - self.pool.num_free

    def check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Refuse a request that could never be admitted, naming the prompt and the setting to raise."""
        if params.n > self.max_num_seqs:
            raise RequestError(f"n={params.n} samples of one prompt exceed the {self.max_num_seqs} sequences the "
                               "sampler runs at once (sampler.max_batch_size, or sampler.options.max_num_seqs)")
        for i, prompt in enumerate(prompts):
            needed = self.worst_case_blocks(len(prompt), params.n, params.max_tokens)
            if needed > self.pool.capacity:
                raise RequestError(f"prompts[{i}] with n={params.n} and max_tokens={params.max_tokens} needs {needed} "
                                   f"KV blocks; the cache has {self.pool.capacity} (raise kv_cache_tokens)")

    def shortfall(self, prompts: list[list[int]], params: SamplingParams) -> str | None:
        """Why the request's groups cannot all run at once (they then run in waves, each decoding to
        its end: a rollout that takes several times its steps), or None. Worst case: no prompt
        blocks found cached. (With blocks lent on demand, a cache too small shows as preemption.)"""
        seqs = len(prompts) * params.n
        if seqs > self.max_num_seqs:
            return f"{seqs} samples exceed max_num_seqs={self.max_num_seqs}"
        blocks = sum(self.worst_case_blocks(len(p), params.n, params.max_tokens) for p in prompts)
        if self.admission == "worst_case" and blocks > self.pool.capacity:
            bs = self.block_size
            return (f"they need {blocks * bs} KV cache tokens and the cache holds {self.pool.capacity * bs} "
                    "(raise gpu_memory_utilization or kv_cache_tokens)")
        return None

    def own_blocks(self, prompt_len: int, new_tokens: int) -> int:
        """Blocks one sample writes beyond the prompt's full blocks for ``new_tokens`` tokens (the last
        sampled token is never cached)."""
        bs = self.block_size
        return math.ceil((prompt_len + new_tokens - 1) / bs) - prompt_len // bs

    def worst_case_blocks(self, prompt_len: int, samples: int, new_tokens: int) -> int:
        """A group's blocks, nothing found cached, every sample drawing ``new_tokens``."""
        return math.ceil(prompt_len / self.block_size) + samples * self.own_blocks(prompt_len, new_tokens)

    def fork_blocks(self, group: PromptGroup) -> int:
        """Blocks each sample of ``group`` takes at its fork: for all its tokens, or (on demand) for
        its first decode step's."""
        left = group.new_tokens()
        return self.own_blocks(len(group.prompt), left if self.admission == "worst_case" else min(left, 2))

    def admit(self, waiting: deque[PromptGroup], num_running: int) -> list[PromptGroup]:
        """Take groups off ``waiting`` while their samples and blocks fit (``num_running``: samples
        running or being prefilled)."""
        admitted: list[PromptGroup] = []
        bs = self.block_size
        while waiting:
            group = waiting[0]
            if num_running + group.samples > self.max_num_seqs:
                break
            if group.digests is None:  # once per group, however long it waits
                group.digests = block_hashes(group.prompt, bs, group.resumes.digests if group.resumes else ())
            hashes = group.digests
            shared = self._cached_prefix(hashes, len(group.prompt))
            needed = self._blocks_to_admit(group, len(shared), num_running) + self.pool.idle(shared)
            if needed > self.pool.num_free - self.reserved:  # idle blocks found cached count as free until shared
                break
            self.reserved += group.samples * self.fork_blocks(group)
            group.epoch = self.epoch
            self.pool.share(shared)
            fresh = self.pool.allocate(math.ceil(len(group.prompt) / bs) - len(shared))
            for digest, block in zip(hashes[len(shared):], fresh, strict=False):
                self.pool.register(block, digest)
            group.blocks, group.cached = shared + fresh, len(shared) * bs
            group.prefilled = group.cached
            num_running += group.samples
            admitted.append(waiting.popleft())
        return admitted

    def _cached_prefix(self, hashes: list[int], prompt_len: int) -> list[int]:
        """The live blocks holding the prompt's leading full blocks (never its last token: its logits
        start the samples)."""
        shared = []
        for digest in hashes:
            block = self.pool.cached(digest)
            if block is None:
                break
            shared.append(block)
        if len(shared) * self.block_size >= prompt_len:
            shared.pop()
        return shared

    def _blocks_to_admit(self, group: PromptGroup, cached_blocks: int, num_running: int) -> int:
        """Free blocks the group needs to be admitted. On demand: its prompt's and its samples' first
        with a block of headroom each (never more than its worst case: a group alone always runs), and
        a block of headroom for every sample running. That headroom is never waived: a small group (a
        preempted sample resuming) let in without it would soon preempt again, the same few samples
        recomputed over and over while the cache is tight."""
        worst = self.worst_case_blocks(len(group.prompt), group.samples, group.new_tokens()) - cached_blocks
        if self.admission == "worst_case":
            return worst
        prompt_blocks = math.ceil(len(group.prompt) / self.block_size) - cached_blocks
        first = prompt_blocks + group.samples * self.fork_blocks(group)
        return min(worst, first + group.samples) + num_running

    def missing_blocks(self, sequence: Sequence, steps: int) -> int:
        """Blocks the sequence lacks to write its K/V in its next ``steps`` decode steps."""
        last = min(len(sequence.tokens) - 2 + steps, sequence.max_len - 2)
        return max(0, last // self.block_size + 1 - len(sequence.blocks))

    def grow(self, running: list[Sequence], steps: int) -> bool:
        """Give every running sequence the blocks for its next ``steps`` decode steps (nothing to do
        when its worst case was reserved); False when the pool runs out first."""
        for sequence in running:
            missing = self.missing_blocks(sequence, steps)
            if missing > self.pool.num_free - self.reserved:
                return False
            sequence.blocks += self.pool.allocate(missing)
        return True

    def preempt(self, running: list[Sequence], steps: int) -> tuple[list[Sequence], list[PromptGroup]]:
        """The newest sequences give their blocks back until the others have blocks for ``steps``
        decode steps: (those kept, each preempted one as a group of one that recomputes it, oldest first)."""
        kept, groups = list(running), []
        missing = [self.missing_blocks(s, steps) for s in kept]
        while kept and sum(missing) > self.pool.num_free - self.reserved:
            sequence = kept.pop()
            missing.pop()
            self.finish(sequence)  # its blocks stay findable: the resumed sample may find them again
            sequence.preempt()
            groups.insert(0, PromptGroup(sequence.prompt_index, list(sequence.tokens), 1, sequence.request,
                                         resumes=sequence))
        return kept, groups

    def next_prefill(self, prefilling: deque[PromptGroup], split: bool) -> list[PrefillPiece]:
        """The prompt tokens of the next prefill step, ``max_prefill_tokens`` at most (at least one
        whole prompt when not ``split``); whole prompts leave ``prefilling``."""
        pieces: list[PrefillPiece] = []
        budget = self.max_prefill_tokens
        while prefilling and budget > 0:
            group = prefilling[0]
            left = len(group.prompt) - group.prefilled
            if not split and pieces and left > budget:
                break
            take = min(left, budget) if split else left
            pieces.append(PrefillPiece(group, group.prefilled, group.prefilled + take))
            group.prefilled += take
            budget -= take
            if group.prefilled == len(group.prompt):
                prefilling.popleft()
        return pieces

    def fork(self, group: PromptGroup, first_tokens: list[int], first_logprobs: list[float],
             version: int) -> list[Sequence]:
        """The samples share the prompt's full blocks; each gets its own copy of a partly filled last
        block. Their first tokens were drawn by policy ``version``."""
        bs = self.block_size
        full = group.blocks[: len(group.prompt) // bs]
        partial = group.blocks[len(full):]
        own_count = self.fork_blocks(group)
        sequences, copies = [], []
        self.reserved -= len(first_tokens) * own_count
        for sample, (token, logprob) in enumerate(zip(first_tokens, first_logprobs, strict=True)):
            own = self.pool.allocate(own_count)
            self.pool.share(full)
            if partial and own:
                copies.append(own[0])
            if group.resumes is None:
                request, prompt_index, _ = group.owner(sample)
                sequence = Sequence(prompt_index, list(group.prompt), len(group.prompt) + request.params.max_tokens,
                                    [], request, group.sample_key(sample), version_at_fork=version)
            else:
                sequence = group.resumes
            sequence.blocks, sequence.digests, sequence.epoch = full + own, group.digests, group.epoch
            sequence.append(token, logprob, version)
            sequences.append(sequence)
        # One copy for all samples (a launch per layer, not per layer and sample).
        self.cache.copy_blocks(partial * len(copies), copies)
        self.pool.release(group.blocks)
        return sequences

    def finish(self, sequence: Sequence) -> None:
        """Its blocks back; those its tokens fill stay findable by a later prompt that begins alike
        (the next turn of a conversation), except past the last token, whose K/V were never written,
        and except when the weights changed since its K/V were computed."""
        if sequence.epoch == self.epoch:
            written = sequence.tokens[: len(sequence.tokens) - 1]
            sequence.digests = block_hashes(written, self.block_size, sequence.digests)  # past its prompt's
            for block, digest in zip(sequence.blocks, sequence.digests, strict=False):
                self.pool.register(block, digest)
        self.pool.release(sequence.blocks)
        sequence.blocks = []
