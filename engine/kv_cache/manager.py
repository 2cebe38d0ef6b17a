"""Owner of the global-KV block pool and the per-sequence state slots (pure Python, no torch).

The model keeps two kinds of per-request state (`engine/models/deepseek_v41/state.py`):

    global KV / index keys   paged: pool blocks of `block_tokens` positions, reached through a
                             per-request block table (table[i] holds positions
                             [i·block_tokens, (i+1)·block_tokens))
    window rings, pending    one "slot" per running sequence: a row index into fixed-size pools
    pairs, token history     (SWA rings, ratio-2 pending pairs, Engram token history)

This manager hands out block ids and slot ids; it never touches tensors. A request holds either
nothing or one slot plus a block table; tables only grow (`allocate`) until `free` returns
everything at once.

    positions   0 ........ 127 | 128 ....... 255 | 256 .. 300
    table       [   17         ,    4            ,    9      ]    num_tokens = 301 -> 3 blocks

Every block carries a reference count: the number of block tables that list it. Today a block is
owned by exactly one request (count 0 or 1); counts are kept so that shared blocks need no new
bookkeeping.

With a `PrefixCache` (`engine/kv_cache/prefix.py`) attached, full blocks stay indexed by chain
key after their holders finish: `allocate` can start a new request's table with cached blocks
(reference count + 1, no copy), a block whose count drops to 0 goes to the cache's LRU instead of
the free list if it is indexed, and allocation evicts LRU blocks only when the free list is
empty. Every block is then free (count 0, not indexed), cached (count 0, indexed, on the LRU) or
in use (count > 0); `num_free_blocks` counts the first two (what an allocation can get).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_cache.prefix import PrefixCache


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of the KV pools. `num_blocks` is discovered at run time (from free device memory)
    by whoever builds the engine and passed in here; it is never written back.

    num_blocks: pool blocks of global KV (ids 0 .. num_blocks − 1).
    num_slots: per-sequence state slots (ids 0 .. num_slots − 1); bounds the running requests.
    block_tokens: positions per block. NOTE: must equal the model's block size
        (`state.BLOCK_TOKENS`, 128); the runner checks it. Tests use small blocks.
    """

    num_blocks: int
    num_slots: int
    block_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_slots", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CacheConfig.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the pools (plain data, for metrics and logs)."""

    num_blocks: int
    num_used_blocks: int  # referenced by a block table
    num_slots: int
    num_used_slots: int
    num_requests: int
    num_cached_blocks: int = 0  # indexed by the prefix cache (in use or evictable)


class KVCacheManager:
    """Allocates pool blocks and state slots to requests, identified by request id.

    Contract (every method says whether it mutates):
      * a request holds nothing, or exactly one slot and a block table (possibly empty);
      * `allocate` is all-or-nothing and only grows a table; `free` returns everything;
      * block ids and slot ids returned earlier stay valid for that request until `free`.
    Not thread-safe: one owner (the scheduler) calls it from one thread.
    """

    def __init__(self, config: CacheConfig, prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.prefix_cache = prefix_cache
        self._free_blocks: deque[int] = deque(range(config.num_blocks))
        self._free_slots: deque[int] = deque(range(config.num_slots))
        self._ref_counts: list[int] = [0] * config.num_blocks
        self._block_tables: dict[str, list[int]] = {}
        self._table_snapshots: dict[str, tuple[int, ...]] = {}  # `block_table` answers, by id
        self._slots: dict[str, int] = {}

    # ---------------------------------------------------------------- queries (no mutation)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus unreferenced cached ones."""
        return len(self._free_blocks) + self._num_evictable()

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold positions `0 .. num_tokens − 1`: ceil(num_tokens / block_tokens)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.config.block_tokens)

    def is_allocated(self, request_id: str) -> bool:
        """Whether the request holds a slot (and hence a block table)."""
        return request_id in self._slots

    def slot(self, request_id: str) -> int:
        """The request's state slot. Raises KeyError if it holds none."""
        try:
            return self._slots[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no slot") from None

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's pool blocks in position order; () if it holds nothing. A snapshot:
        later `allocate` calls append to the request's table but never change these entries.
        NOTE: the same tuple object is returned until the table grows (callers may compare
        snapshots by identity)."""
        snapshot = self._table_snapshots.get(request_id)
        if snapshot is None:
            table = self._block_tables.get(request_id)
            if table is None:
                return ()
            snapshot = self._table_snapshots[request_id] = tuple(table)
        return snapshot

    def can_allocate(
        self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Whether `allocate(request_id, num_tokens, cached_blocks)` would succeed now.
        No mutation."""
        if request_id in self._slots:
            if cached_blocks:
                return False
            return self._num_missing_blocks(request_id, num_tokens) <= self.num_free_blocks
        if not self._free_slots:
            return False
        cache = self.prefix_cache
        num_locked = sum(1 for b in cached_blocks if cache is not None and cache.is_evictable(b))
        num_missing = max(0, self.num_blocks_needed(num_tokens) - len(cached_blocks))
        return num_missing <= self.num_free_blocks - num_locked

    def usage(self) -> float:
        """Fraction of pool blocks referenced by running requests, in [0, 1] (cached blocks
        nobody holds are reclaimable and do not count)."""
        return 1.0 - self.num_free_blocks / self.config.num_blocks

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.config.num_blocks,
            num_used_blocks=self.config.num_blocks - self.num_free_blocks,
            num_slots=self.config.num_slots,
            num_used_slots=self.config.num_slots - len(self._free_slots),
            num_requests=len(self._slots),
            num_cached_blocks=0
            if self.prefix_cache is None
            else self.prefix_cache.stats().num_cached_blocks,
        )

    # ---------------------------------------------------------------- mutations

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Make the request hold a slot and enough blocks for positions `< num_tokens`.

        cached_blocks: for a request that holds nothing yet, cached blocks (from
            `PrefixCache.match`) that become the first entries of its table, shared, not copied.
        Mutates: on success the request gets a slot (if it had none) and its table grows to
        `num_blocks_needed(num_tokens)` blocks (never shrinks: a smaller `num_tokens` is a
        no-op), taking free blocks first and evicting the least recently used cached blocks
        only when none is free. Earlier block ids and the slot stay valid. On failure (not
        enough blocks, no free slot for a new request, or cached blocks for a request that
        already holds a table) nothing changes and False is returned.
        """
        table = self._block_tables.get(request_id)
        if (
            table is not None
            and not cached_blocks
            and num_tokens <= len(table) * self.config.block_tokens
        ):
            return True  # the common case: a decode row inside its last block
        if not self.can_allocate(request_id, num_tokens, cached_blocks):
            return False
        if request_id not in self._slots:
            self._slots[request_id] = self._free_slots.popleft()
            self._block_tables[request_id] = []
            for block in cached_blocks:
                self._hold(block)
                self._block_tables[request_id].append(block)
        table = self._block_tables[request_id]
        num_missing = self._num_missing_blocks(request_id, num_tokens)
        if num_missing > len(self._free_blocks):
            assert self.prefix_cache is not None  # can_allocate counted the evictable blocks
            self._free_blocks.extend(self.prefix_cache.evict(num_missing - len(self._free_blocks)))
        for _ in range(num_missing):
            block = self._free_blocks.popleft()
            self._hold(block)
            table.append(block)
        if num_missing or cached_blocks:
            self._table_snapshots.pop(request_id, None)
        return True

    def free(self, request_id: str) -> None:
        """Return the request's blocks and slot to the pools.

        Mutates: the request then holds nothing; its slot and block ids become invalid for it
        (other requests may receive them). A request id that holds nothing (unknown, or freed
        already) is a no-op: state is keyed by request id, so a second `free` finds nothing
        and can never return a block or slot twice.
        NOTE: blocks go back last-block-first, so the tail of a sequence (the part least likely
        to be a shared prefix later) is reused first, and among cached blocks released together
        the deepest is the oldest on the LRU (leaves are evicted before their ancestors).
        """
        slot = self._slots.pop(request_id, None)
        if slot is None:
            return
        self._table_snapshots.pop(request_id, None)
        for block in reversed(self._block_tables.pop(request_id)):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                cache = self.prefix_cache
                if cache is None or not cache.unlock(block):
                    self._free_blocks.append(block)
        self._free_slots.append(slot)

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant. No mutation.

        Invariants: every block is either free (count 0, not indexed), cached and unreferenced
        (count 0, on the prefix cache's LRU) or listed by tables exactly `count` times; no table
        lists a block twice; free lists hold no duplicates or out-of-range ids; every slot is
        either free or assigned to exactly one request; the requests holding slots are exactly
        those holding tables; counts add up. Checks the prefix cache's own invariants too.
        """
        cache = self.prefix_cache
        evictable = set()
        on_free_list = set(self._free_blocks)
        if cache is not None:
            cache.check_integrity()
            cached = self._cached_blocks()
            evictable = {b for b in cached if cache.is_evictable(b)}
            for block in cached:
                _require(0 <= block < self.config.num_blocks, f"cached block {block} out of range")
                _require(block not in on_free_list, f"cached block {block} is on the free list")
                _require(
                    (self._ref_counts[block] == 0) == (block in evictable),
                    f"cached block {block} has count {self._ref_counts[block]} but is "
                    f"{'' if block in evictable else 'not '}on the LRU",
                )
            _require(
                len(evictable) == cache.num_evictable, "the LRU holds a block that is not cached"
            )
        num_blocks, num_slots = self.config.num_blocks, self.config.num_slots
        free_blocks = set(self._free_blocks)
        _require(
            len(free_blocks) == len(self._free_blocks),
            "a block id appears twice in the free list",
        )
        _require(
            all(0 <= b < num_blocks for b in free_blocks), "free list holds an out-of-range block"
        )
        _require(
            self._slots.keys() == self._block_tables.keys(),
            "requests holding slots differ from requests holding block tables",
        )
        for request_id, snapshot in self._table_snapshots.items():
            _require(
                snapshot == tuple(self._block_tables.get(request_id, ())),
                f"request {request_id!r}: its block-table snapshot differs from its table",
            )
        owners: dict[int, int] = {}
        for request_id, table in self._block_tables.items():
            _require(
                len(set(table)) == len(table),
                f"request {request_id!r} lists a block twice in its table {table}",
            )
            for block in table:
                _require(0 <= block < num_blocks, f"request {request_id!r} holds bad block {block}")
                _require(
                    block not in free_blocks,
                    f"block {block} is both free and owned by request {request_id!r}",
                )
                owners[block] = owners.get(block, 0) + 1
        for block, count in enumerate(self._ref_counts):
            _require(
                count == owners.get(block, 0),
                f"block {block} has reference count {count} but is listed by "
                f"{owners.get(block, 0)} block tables",
            )
            _require(
                count > 0 or block in free_blocks or block in evictable,
                f"block {block} is neither free, cached nor owned",
            )
        _require(
            len(free_blocks) + len(evictable) + len(owners) == num_blocks,
            f"blocks do not add up: {len(free_blocks)} free + {len(evictable)} cached + "
            f"{len(owners)} owned != {num_blocks}",
        )
        free_slots = set(self._free_slots)
        used_slots = list(self._slots.values())
        _require(
            len(free_slots) == len(self._free_slots), "a slot id appears twice in the free list"
        )
        _require(len(set(used_slots)) == len(used_slots), "a slot is assigned to two requests")
        _require(not free_slots & set(used_slots), "a slot is both free and assigned")
        _require(
            free_slots | set(used_slots) == set(range(num_slots)),
            f"slots do not add up: {len(free_slots)} free + {len(used_slots)} assigned "
            f"!= {num_slots} (or an id is out of range)",
        )

    # ---------------------------------------------------------------- helpers

    def _hold(self, block: int) -> None:
        self._ref_counts[block] += 1
        if self._ref_counts[block] == 1 and self.prefix_cache is not None:
            self.prefix_cache.lock(block)

    def _num_evictable(self) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.num_evictable

    def _cached_blocks(self) -> list[int]:
        cache = self.prefix_cache
        if cache is None:
            return []
        return [b for b in range(self.config.num_blocks) if cache.is_cached(b)]

    def _num_missing_blocks(self, request_id: str, num_tokens: int) -> int:
        num_held = len(self._block_tables.get(request_id, ()))
        return max(0, self.num_blocks_needed(num_tokens) - num_held)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"KVCacheManager integrity: {message}")
