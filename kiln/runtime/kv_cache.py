"""Block bookkeeping of the paged KV cache: which blocks each request owns. Plain Python, no torch."""
from __future__ import annotations

from collections import deque

from .request import Request


class KVCacheManager:
    """A pool of `num_blocks` blocks of `tokens_per_block` slots; requests own whole blocks."""

    def __init__(self, num_blocks: int, tokens_per_block: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(request.block_ids) <= self.num_free_blocks

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` tokens; False (and no change) if the pool is short."""
        if not self.can_allocate(request, num_tokens):
            return False
        while len(request.block_ids) < self.blocks_for(num_tokens):
            request.block_ids.append(self.free_blocks.popleft())
        return True

    def free(self, request: Request) -> None:
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []
