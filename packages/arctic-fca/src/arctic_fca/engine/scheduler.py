"""Admission and KV blocks: which prompt groups run next, the blocks they take, which of their
prompt tokens each prefill step computes, and the fork of a prefilled prompt into its ``n`` samples.

A group is admitted while its worst case fits: its prompt's blocks not already cached (the prefix
index finds full blocks another prompt holds), plus ``n`` times the blocks for ``max_tokens``. The
prompt's blocks are taken at admission and its samples' are held in reserve until the fork takes
them, so a running sequence never waits for memory and nothing is ever preempted.

Admitted prompts are computed first in, first out, ``max_prefill_tokens`` per step: a prompt whose
blocks another admitted prompt shares is therefore never computed before them.
"""

from __future__ import annotations

import math
from collections import deque

from arctic_core.config import SamplingParams
from arctic_core.errors import RequestError
from arctic_fca.engine.blocks import BlockPool, block_hashes
from arctic_fca.engine.kv_cache import PagedKVCache
from arctic_fca.engine.sequence import PrefillPiece, PromptGroup, Sequence


class Scheduler:
    def __init__(self, cache: PagedKVCache, block_size: int, max_num_seqs: int, max_prefill_tokens: int) -> None:
        self.cache, self.block_size = cache, block_size
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.pool = BlockPool(cache.num_blocks)
        self.reserved = 0  # free blocks promised to the samples of admitted groups not yet forked

    def reset(self) -> None:
        """Every block back (after a failed call: calls are serialised, so all were that call's)."""
        self.pool, self.reserved = BlockPool(self.pool.num_blocks), 0

    def check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Refuse a request that could never be admitted, naming the prompt and the setting to raise."""
        if params.n > self.max_num_seqs:
            raise RequestError(f"n={params.n} exceeds the engine's max_num_seqs={self.max_num_seqs}")
        for i, prompt in enumerate(prompts):
            needed = self.group_blocks(len(prompt), 0, params)
            if needed > self.pool.capacity:
                raise RequestError(f"prompts[{i}] with n={params.n} and max_tokens={params.max_tokens} needs {needed} KV "
                                   f"blocks; the cache has {self.pool.capacity} (raise kv_cache_tokens)")

    def shortfall(self, prompts: list[list[int]], params: SamplingParams) -> str | None:
        """Why the request's groups cannot all run at once (they then run in waves, each decoding to
        its end: a rollout that takes several times its steps), or None. Worst case: no prompt
        blocks found cached."""
        seqs, blocks = len(prompts) * params.n, sum(self.group_blocks(len(p), 0, params) for p in prompts)
        if seqs > self.max_num_seqs:
            return f"{seqs} samples exceed max_num_seqs={self.max_num_seqs}"
        if blocks > self.pool.capacity:
            bs = self.block_size
            return (f"they need {blocks * bs} KV cache tokens and the cache holds {self.pool.capacity * bs} "
                    "(raise gpu_memory_utilization or kv_cache_tokens)")
        return None

    def own_blocks(self, prompt_len: int, params: SamplingParams) -> int:
        """Blocks one sample writes beyond the prompt's full blocks (the last sampled token is never cached)."""
        bs = self.block_size
        return math.ceil((prompt_len + params.max_tokens - 1) / bs) - prompt_len // bs

    def group_blocks(self, prompt_len: int, cached_blocks: int, params: SamplingParams) -> int:
        prompt_blocks = math.ceil(prompt_len / self.block_size) - cached_blocks
        return prompt_blocks + params.n * self.own_blocks(prompt_len, params)

    def admit(self, waiting: deque[PromptGroup], num_running: int, params: SamplingParams) -> list[PromptGroup]:
        """Take groups off ``waiting`` while their samples and blocks fit (``num_running``: samples
        running or being prefilled)."""
        admitted: list[PromptGroup] = []
        bs = self.block_size
        while waiting:
            group = waiting[0]
            if num_running + (len(admitted) + 1) * params.n > self.max_num_seqs:
                break
            hashes = block_hashes(group.prompt, bs)
            shared = []
            for digest in hashes:
                block = self.pool.cached(digest)
                if block is None:
                    break
                shared.append(block)
            if len(shared) * bs >= len(group.prompt):
                shared.pop()  # keep the last prompt token to compute: its logits start the samples
            if self.group_blocks(len(group.prompt), len(shared), params) > self.pool.num_free - self.reserved:
                break
            self.reserved += params.n * self.own_blocks(len(group.prompt), params)
            self.pool.share(shared)
            fresh = self.pool.allocate(math.ceil(len(group.prompt) / bs) - len(shared))
            for digest, block in zip(hashes[len(shared):], fresh, strict=False):
                self.pool.register(block, digest)
            group.blocks, group.cached = shared + fresh, len(shared) * bs
            group.prefilled = group.cached
            admitted.append(waiting.popleft())
        return admitted

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

    def fork(self, group: PromptGroup, params: SamplingParams, first_tokens: list[int], first_logprobs: list[float],
             stops: set[int]) -> list[Sequence]:
        """The n samples share the prompt's full blocks; each gets its own copy of a partly filled last block."""
        bs = self.block_size
        full = group.blocks[: len(group.prompt) // bs]
        partial = group.blocks[len(full):]
        sequences, copies = [], []
        self.reserved -= len(first_tokens) * self.own_blocks(len(group.prompt), params)
        for token, logprob in zip(first_tokens, first_logprobs, strict=True):
            own = self.pool.allocate(self.own_blocks(len(group.prompt), params))
            self.pool.share(full)
            if partial and own:
                copies.append(own[0])
            sequence = Sequence(group.prompt_index, list(group.prompt), len(group.prompt) + params.max_tokens, full + own)
            sequence.append(token, logprob, stops)
            sequences.append(sequence)
        # One copy for all samples (a launch per layer, not per layer and sample).
        self.cache.copy_blocks(partial * len(copies), copies)
        self.pool.release(group.blocks)
        return sequences

    def finish(self, sequence: Sequence) -> None:
        self.pool.release(sequence.blocks)
