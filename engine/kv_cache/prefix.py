"""The GPU tier of the prefix cache: an index of full pool blocks by chain key (`cache.md` §2.2).

Pure Python, no torch: it maps 32-byte block keys (`engine/kv_cache/hashing.py`) to block ids of
the `KVCacheManager`'s pool and keeps the unreferenced ones in an LRU. The manager owns the
reference counts and tells this index when a block gains its first holder (`lock`) or loses its
last one (`unlock`); so every pool block is in exactly one of three states:

    free        count 0, not indexed              on the manager's free list
    cached      count 0, indexed                  on this LRU (oldest first), evictable
    in use      count > 0, indexed or not         in block tables; never evicted

A block is indexed once all its positions are computed (it is then immutable: every later reader
only reads it) and stays indexed until `evict` hands it back to the manager for reuse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """num_cached_blocks: indexed blocks (in use or not); num_evictable_blocks: indexed and
    unreferenced (the LRU); num_inserted / num_evicted: blocks indexed / evicted since start."""

    num_cached_blocks: int
    num_evictable_blocks: int
    num_inserted: int
    num_evicted: int


class PrefixCache:
    """Key → block index of full blocks plus an LRU of the unreferenced ones.

    Contract (each method says whether it mutates): a key maps to at most one block and a block
    holds at most one key; only indexed blocks are ever on the LRU. Not thread-safe: one owner
    (the scheduler, through the manager) calls it from one thread.
    """

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = (
            OrderedDict()
        )  # unreferenced cached blocks, oldest first
        self._num_inserted = 0
        self._num_evicted = 0

    # ---------------------------------------------------------------- queries (no mutation)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids of the longest indexed prefix of `keys` (a chain: stops at the first miss).
        No mutation: the caller takes the blocks through the manager, which locks them."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_cached(self, block: int) -> bool:
        """Whether `block` is indexed."""
        return block in self._key_of

    def is_evictable(self, block: int) -> bool:
        """Whether `block` is indexed and unreferenced (on the LRU)."""
        return block in self._lru

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_cached_blocks=len(self._key_of),
            num_evictable_blocks=len(self._lru),
            num_inserted=self._num_inserted,
            num_evicted=self._num_evicted,
        )

    # ---------------------------------------------------------------- mutations

    def insert(self, key: bytes, block: int) -> bool:
        """Index a block that is in use and whose positions are all computed.

        Mutates: on success `key` → `block`. Returns False, changing nothing, when the key is
        already indexed (another block holds the same prefix: the first writer wins, the caller's
        copy stays unindexed and is freed normally) or the block already holds a key.
        """
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        self._num_inserted += 1
        return True

    def lock(self, block: int) -> None:
        """The block gained its first holder: it leaves the LRU (no-op if it is not on it)."""
        self._lru.pop(block, None)

    def unlock(self, block: int) -> bool:
        """The block lost its last holder. Mutates: an indexed block joins the LRU as the most
        recently used and True is returned; an unindexed one is left alone (False: the caller
        frees it)."""
        if block not in self._key_of:
            return False
        self._lru[block] = None
        self._lru.move_to_end(block)
        return True

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to `num_blocks` least recently used unreferenced blocks from the index and
        return them (the caller puts them on its free list). In-use blocks are never evicted."""
        evicted = []
        while self._lru and len(evicted) < num_blocks:
            block, _ = self._lru.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            evicted.append(block)
        self._num_evicted += len(evicted)
        return evicted

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant. No mutation.

        Invariants: the index is a bijection between keys and blocks; every LRU block is
        indexed; keys are 32 bytes.
        """
        _require(len(self._block_of) == len(self._key_of), "index sizes differ")
        for key, block in self._block_of.items():
            _require(self._key_of.get(block) == key, f"block {block} does not map back to its key")
            _require(len(key) == 32, f"block {block} has a key of {len(key)} bytes")
        for block in self._lru:
            _require(block in self._key_of, f"LRU block {block} is not indexed")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"PrefixCache integrity: {message}")
