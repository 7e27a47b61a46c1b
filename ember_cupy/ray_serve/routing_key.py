"""The key prefix-aware routing compares: the chain hashes of a prompt's full token blocks.

They are the engine's own block hashes (BlockManager.hash_block: parent digest, cache salt, token
ids), so two requests share a routing-key prefix exactly when a replica could serve the shared
part from its prefix cache, in whole blocks, and never across cache salts. Token blocks rather
than text prefixes: the engine caches in blocks of block_size tokens, so a text match shorter
than a block, or one that tokenizes differently, buys nothing.
"""
from __future__ import annotations

from ember_cupy.engine.block_manager import BlockManager


class RoutingKeys:
    """block_size-token chain hashes of a prompt, with the engine's hash function."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._hash_block = BlockManager(num_blocks=1, block_size=block_size).hash_block

    def of(self, token_ids, cache_salt: str | None) -> tuple[bytes, ...]:
        """The chain hashes of a prompt's full blocks of token ids (a 16-byte prefix of each: ample
        for routing, which is only a guess; the engine confirms hits on whole digests and tokens)."""
        ids = list(token_ids)
        hashes, parent = [], None
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            parent = self._hash_block(parent, ids[start:start + self.block_size], cache_salt)
            hashes.append(parent[:16])
        return tuple(hashes)
