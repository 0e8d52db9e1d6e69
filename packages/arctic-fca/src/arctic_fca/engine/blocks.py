"""KV-cache block bookkeeping: a free list with reference counts, and a prefix index.

Blocks are shared by reference: the n samples of a prompt point at the prompt's full blocks, and
prompts that begin alike (a shared system prompt) share the blocks of their common full-block
prefix, found by chained content hashes. A block returns to the free list when its last user
lets go, and leaves the prefix index with it (the index never holds a block alive by itself).
"""

from __future__ import annotations

from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    """Blocks ``1 .. num_blocks - 1``; block 0 is never handed out: it is the scratch block that
    padding rows of a CUDA-graph batch read and write."""

    SCRATCH = 0

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} KV blocks, {len(self._free)} free of {self.capacity}")
        blocks = [self._free.pop() for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
                digest = self._hash_of.pop(b, None)
                if digest is not None:
                    del self._block_of[digest]

    def cached(self, digest: int) -> int | None:
        """The live block holding the full-block prefix with this chained hash, if any."""
        return self._block_of.get(digest)

    def register(self, block: int, digest: int) -> None:
        """Index ``block`` under ``digest``, unless a live block already holds that prefix (a prompt
        found whole in the cache recomputes its last block into a block of its own)."""
        if digest in self._block_of:
            return
        self._hash_of[block] = digest
        self._block_of[digest] = block

    def clear_index(self) -> None:
        """Forget every cached prefix (after a weight update their K/V are stale)."""
        self._hash_of.clear()
        self._block_of.clear()


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``: equal hashes mean equal whole prefixes."""
    digests, previous = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        digests.append(previous)
    return digests
