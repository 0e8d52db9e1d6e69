"""The paged KV cache: per layer, keys and values as ``[num_blocks, block_size, num_kv_heads, head_dim]``
(the layout of ``arctic_fca.fca.layout``). Freed on sleep, allocated again on wake."""

from __future__ import annotations

import torch

from arctic_core.batch import to_device


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.allocate()

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def block_size(self) -> int:
        return self.shape[1]

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def allocate(self) -> None:
        def make() -> torch.Tensor:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

        self.keys = [make() for _ in range(self.num_layers)]
        self.values = [make() for _ in range(self.num_layers)]

    def free(self) -> None:
        self.keys, self.values = [], []

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key/value [tokens, num_kv_heads, head_dim]`` at flat slots ``block * block_size + offset``."""
        self.keys[layer].view(-1, *self.shape[2:])[slots] = key
        self.values[layer].view(-1, *self.shape[2:])[slots] = value

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Copy whole blocks in every layer (a prompt's partly filled last block, once per sample)."""
        if not sources:
            return
        # Without waiting for the prefill passes queued before it.
        src, dst = (to_device(torch.tensor(blocks), self.device) for blocks in (sources, targets))
        for cache in (*self.keys, *self.values):
            cache[dst] = cache[src]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
