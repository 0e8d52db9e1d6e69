"""KV-cache block bookkeeping: a free list with reference counts, and a prefix index.

Blocks are shared by reference: the n samples of a prompt point at the prompt's full blocks, and
prompts that begin alike (a shared system prompt) share the blocks of their common full-block
prefix, found by chained content hashes. A block whose last user lets go stays in the index, its
K/V intact, until the free list runs dry and it is taken for new work, least recently released
first (vLLM's prefix caching): a later prompt that begins alike (the next turn of a conversation,
a preempted sample resuming) finds it there. Such idle blocks count as free.
"""

from __future__ import annotations

from collections import OrderedDict
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
        self._idle: OrderedDict[int, None] = OrderedDict()  # indexed blocks no one uses, least recently released first

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfBlocks(f"need {count} KV blocks, {self.num_free} free of {self.capacity}")
        blocks = [self._free.pop() if self._free else self._evict() for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def _evict(self) -> int:
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def share(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:  # found in the index after its last user let go
                del self._idle[b]
            self._refs[b] += 1

    def idle(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` no one uses (counted free until shared)."""
        return sum(self._refs[b] == 0 for b in blocks)

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    def cached(self, digest: int) -> int | None:
        """The block holding the full-block prefix with this chained hash, if any (in use or idle)."""
        return self._block_of.get(digest)

    def register(self, block: int, digest: int) -> None:
        """Index ``block`` under ``digest``, unless a block already holds that prefix (a prompt found
        whole in the cache recomputes its last block into a block of its own; samples alike)."""
        if digest in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = digest
        self._block_of[digest] = block

    def clear_index(self) -> None:
        """Forget every cached prefix (after a weight update their K/V are stale)."""
        self._free.extend(reversed(self._idle))
        self._idle.clear()
        self._hash_of.clear()
        self._block_of.clear()


def block_hashes(tokens: Sequence[int], block_size: int, known: Sequence[int] = ()) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``: equal hashes mean equal whole prefixes.
    ``known``: the hashes of its first blocks, already computed (the chain goes on from them)."""
    digests, previous = list(known), known[-1] if known else 0
    for start in range(len(known) * block_size, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        digests.append(previous)
    return digests
