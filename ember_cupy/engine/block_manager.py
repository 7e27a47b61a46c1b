"""Paged KV-cache bookkeeping: block tables, refcounts, prefix caching, copy-on-write.

Only full blocks are ever cached: each gets a chain hash, the SHA-256 digest of (parent digest,
cache salt, its token ids as packed int32), so equal hashes mean equal prefixes: a collision
(which would serve one tenant's KV to another) is as hard as a SHA-256 collision, not Python's
hash() of a tuple. A hit is still confirmed on the block's own tokens. Blocks whose refcount drops to
the free queue but keep their hash, so a later request can revive them; allocation takes the
least recently freed block and only then forgets its hash (LRU eviction).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ember_cupy.engine.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()   # the tokens behind block_hash, to confirm a hit


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # prompt tokens served from the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}   # block hash -> block id
        self.prefix_stats = PrefixCacheStats()

    # --- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks `seq` needs to hold num_new_tokens more computed tokens."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        needed = max(0, total - len(seq.block_table))
        if self._last_block_is_shared(seq, num_new_tokens):
            needed += 1  # copy-on-write of a partial block shared with a fork
        return needed

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    # --- prefix cache -------------------------------------------------------------------
    def hash_block(self, parent_hash: bytes | None, token_ids, cache_salt: str | None) -> bytes:
        """SHA-256 over an unambiguous encoding: a tag byte and the parent's digest (none for the
        first block), the salt's length and UTF-8 bytes (none marked apart from ""), then the
        tokens as native int32s up to the end."""
        h = hashlib.sha256(b"\x00" if parent_hash is None else b"\x01" + parent_hash)
        if cache_salt is None:
            h.update(b"\xff\xff\xff\xff")
        else:
            salt = cache_salt.encode("utf-8", "surrogatepass")
            h.update(len(salt).to_bytes(4, "little") + salt)
        h.update(array("i", token_ids).tobytes())
        return h.digest()

    def acquire_cached_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the longest run of cached blocks of its tokens.

        The block holding the last token is never taken from the cache: that token must be
        computed to produce logits. Returns the number of tokens served from the cache.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need the logits of every prompt position
        bs = self.block_size
        parent = None
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start:start + bs])
            block_hash = self.hash_block(parent, tokens, seq.cache_salt)
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
            parent = block_hash
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def record_prefix_query(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prefix_stats.queries += num_prompt_tokens
        self.prefix_stats.hits += num_cached_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[index * bs:(index + 1) * bs])
            block_hash = self.hash_block(parent, tokens, seq.cache_salt)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash, block.token_ids = block_hash, tokens
                self.cached[block_hash] = block.block_id

    # --- allocation ---------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Grow seq's table for num_new_tokens more tokens. Returns (src, dst) block copies
        the runner must perform first (copy-on-write of a shared partial block)."""
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("KV pool exhausted: scheduler must check can_allocate first")
        copies = []
        if self._last_block_is_shared(seq, num_new_tokens):
            old = seq.block_table[-1]
            new = self._take_fresh()
            self._release(old)
            seq.block_table[-1] = new
            copies.append((old, new))
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_fresh())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks (refcount); appends copy on write."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        for block_id in child.block_table:
            self._take(block_id)

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past seq's computed tokens (the pages of rejected drafts). They
        hold no full computed block, so they have no hash."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks; the tail goes first so it is evicted first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    # --- internals ----------------------------------------------------------------------
    def _last_block_is_shared(self, seq: Sequence, num_new_tokens: int) -> bool:
        if num_new_tokens == 0 or seq.num_computed_tokens % self.block_size == 0:
            return False  # the next token starts a new block
        last = self.blocks[seq.block_table[-1]]
        return last.ref_count > 1

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released more often than taken"
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:  # nothing to keep: reuse it before cached blocks
                self.free_queue.move_to_end(block_id, last=False)
