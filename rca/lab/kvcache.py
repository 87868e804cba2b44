"""The paged KV cache: a pool of fixed-size blocks, an allocator with refcounts,
and per-sequence block tables (vLLM's layout)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

__all__ = ["KVPool", "BlockAllocator", "NoFreeBlocksError", "blocks_needed"]


class NoFreeBlocksError(ValueError):
    """Not enough free blocks (vLLM's wording)."""

    def __init__(self, wanted: int) -> None:
        super().__init__(f"Cannot get {wanted} free blocks from the pool")
        self.wanted = wanted


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVPool:
    """``k``, ``v``: ``[layers, num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) ``[num_blocks, block_size, kv_heads, head_dim]``: the
        layout :class:`probes.kvcache.KVBlockChecker` fingerprints."""
        return [(self.k[i], self.v[i]) for i in range(self.num_layers)]

    @property
    def bytes_per_block(self) -> int:
        per = self.k[0, 0].numel() * self.k.element_size()
        return 2 * self.num_layers * per


class BlockAllocator:
    """Free list plus refcounts; a block goes back to the free list when its
    last holder frees it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(n)
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    def share(self, ids: Iterable[int]) -> None:
        for b in ids:
            self.refcount[b] += 1

    def free(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference of each block; return the blocks now free."""
        released = []
        for b in ids:
            if self.refcount[b] <= 0:
                continue
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)
                released.append(b)
        return released
