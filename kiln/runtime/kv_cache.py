"""Block bookkeeping of the paged KV cache, with prefix reuse. Plain Python, no torch.

Blocks hold `tokens_per_block` tokens. A full, computed block is registered under a key made of its tokens and
the key of the block before it, so a later sequence with the same prefix finds it. The key is a SHA-256 digest:
equal keys mean equal prefixes, as no one can craft a collision (Python's hash() collides on demand, so a
request could plant blocks another prompt's prefix would reuse — vLLM's CVE-2025-25183). Blocks are reference
counted; a block whose count drops to zero goes to the back of the free queue but keeps its contents and key
until it is taken for something else (LRU eviction from the front).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .request import Sequence

BlockKey = bytes  # SHA-256 of (the previous block's key, this block's token ids)


def block_key(parent: BlockKey | None, tokens: list[int], salt: bytes = b"") -> BlockKey:
    """The key of a full block: its token ids (8 bytes each) after its parent's key (none for the first block,
    whose digest input is then shorter by the key's 32 bytes, so the two cannot be confused). A first block of a
    request with a `salt` (its LoRA adapter's 32 bytes, LoRARequest.cache_salt) has the salt and one more byte
    before its tokens: 33 bytes, a length no other first or later block's input has (modulo 8), so KV computed
    under one adapter is never found by a request with another, or with none."""
    if parent is None and salt:
        return hashlib.sha256(salt + b"L" + array("q", tokens).tobytes()).digest()
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


@dataclass
class KVCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Which blocks each sequence owns, which are shared, and which full blocks are cached for reuse."""

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_reuse: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks, self.tokens_per_block, self.enable_reuse = num_blocks, tokens_per_block, enable_reuse
        self.ref_counts = [0] * num_blocks
        self.keys: list[BlockKey | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: evicted first
        self.cached: dict[BlockKey, int] = {}
        self.stats = KVCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be taken now (unused, or cached but unreferenced)."""
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # --- prefix reuse -------------------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence, salt: bytes = b"") -> list[int]:
        """Cached blocks matching the sequence's leading full blocks (at least one token is left to compute), keyed
        with its request's `salt` (Request.cache_salt)."""
        if not self.enable_reuse:
            return []
        bs, hits, parent = self.tokens_per_block, [], None
        for i in range((seq.num_tokens - 1) // bs):
            key = block_key(parent, seq.token_ids[i * bs:(i + 1) * bs], salt)
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
            parent = key
        return hits

    def adopt_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a sequence without blocks the cached prefix `blocks`; their tokens count as computed."""
        assert not seq.block_ids, "adopt_prefix needs a sequence without blocks"
        for block in blocks:
            self._ref(block)
        seq.block_ids = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.tokens_per_block

    def register_full_blocks(self, seq: Sequence, salt: bytes = b"") -> None:
        """Make the sequence's computed full blocks findable by later sequences (of a request with the same
        `salt`)."""
        if not self.enable_reuse:
            return
        bs = self.tokens_per_block
        keys = seq.block_keys
        for i in range(len(keys), seq.num_computed_tokens // bs):
            key = block_key(keys[-1] if keys else None, seq.token_ids[i * bs:(i + 1) * bs], salt)
            block = seq.block_ids[i]
            if key not in self.cached and self.keys[block] is None:
                self.cached[key], self.keys[block] = block, key
            keys.append(key)

    # --- allocation ---------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_ids) <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the sequence's blocks to hold `num_tokens` tokens; False (and no change) if the pool is short."""
        if not self.can_allocate(seq, num_tokens):
            return False
        while len(seq.block_ids) < self.blocks_for(num_tokens):
            seq.block_ids.append(self._take_free())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share the parent's full blocks with the child. If the parent's last block is partly filled, the child
        gets a fresh block and the returned (src, dst) copy must be done before either writes to it."""
        bs = self.tokens_per_block
        full = parent.num_computed_tokens // bs
        for block in parent.block_ids[:full]:
            self._ref(block)
        child.block_ids = parent.block_ids[:full]
        child.block_keys = list(parent.block_keys)
        if parent.num_computed_tokens % bs == 0:
            return None
        if not self.free:
            raise RuntimeError("KV cache exhausted while forking a sequence (scheduler invariant broken)")
        dst = self._take_free()
        child.block_ids.append(dst)
        return parent.block_ids[full], dst

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's references, last block first (so its tail is evicted before its prefix)."""
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_ids = []
        seq.block_keys = []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the sequence's blocks past those `num_tokens` tokens fill (speculative decoding: blocks that held
        only rejected drafts), last first."""
        keep = self.blocks_for(num_tokens)
        for block in reversed(seq.block_ids[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        del seq.block_ids[keep:]

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self.keys[block] = None
        self.cached.clear()

    # --- internals ----------------------------------------------------------------------------------------
    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.keys[block]
        if key is not None:
            del self.cached[key]
            self.keys[block] = None
            self.stats.evictions += 1
        self.ref_counts[block] = 1
        return block
