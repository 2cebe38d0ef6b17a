"""The host tier of the prefix cache (`cache.md` §2.3): cached blocks in host memory, under the
GPU tier and above the directory tiers.

A pool of fixed-size slots (pinned memory on CUDA, plain memory on the CPU) holding canonical
block payloads (`cache.md` §1.3; the slot's bytes are exactly a directory file's payload), a
key → slot index, a CRC-32 per slot and an LRU of the slots nobody is copying. Every key is in
one of three states:

    filling    a copy into the slot is in flight (GPU → host); not readable, not evictable
    ready      payload and checksum valid; on the LRU unless pinned
    pinned     ready, and a copy out of the slot (host → GPU) is in flight; not evictable

Copies are issued by the caller, who hands the pool a `CopyHandle` saying when one is done;
`poll` (called every step) turns finished fills ready and releases finished pins, so nothing
here waits on a device. Slot memory is allocated in chunks as the pool fills (a large budget
costs nothing until it is used).

Reads check the slot's checksum: a corrupt slot is dropped and counted, and the read stops
there (a miss, never wrong bytes). Not thread-safe: one owner (the scheduler's prefix-cache
collaborator) calls it from one thread.
"""

from __future__ import annotations

import os
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

from engine.kv_cache.store.format import padded_len

# The default budget: this share of the memory available at start (MemAvailable), split
# between the engine ranks of the machine.
DEFAULT_HOST_FRACTION = 0.2
_CHUNK_BYTES = 16 << 20


class CopyHandle(Protocol):
    """A copy in flight; `is_done` never waits, `wait` blocks until it is done."""

    def is_done(self) -> bool: ...

    def wait(self) -> None: ...


class _Done:
    def is_done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE: CopyHandle = _Done()


@dataclass(frozen=True)
class HostPoolConfig:
    """max_bytes: the budget (slots of `padded_len(payload_len)` bytes; >= one slot).
    payload_len: bytes of one block payload. pin_memory: page-locked slots (CUDA hosts)."""

    max_bytes: int
    payload_len: int
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.payload_len < 1:
            raise ValueError("HostPoolConfig.payload_len must be >= 1")
        if self.max_bytes < padded_len(self.payload_len):
            raise ValueError(
                f"a host KV budget of {self.max_bytes} bytes holds no block of "
                f"{padded_len(self.payload_len)} bytes"
            )

    @property
    def slot_bytes(self) -> int:
        return padded_len(self.payload_len)

    @property
    def num_slots(self) -> int:
        return self.max_bytes // self.slot_bytes


@dataclass(frozen=True)
class HostPoolStats:
    """num_blocks: keys held (filling or ready); num_bytes: their slots' bytes; num_hits:
    blocks read out (to the GPU); num_evicted: blocks evicted for room; num_corrupt: reads
    that found a bad checksum; num_dropped: blocks not stored (every slot busy);
    copied_bytes: "src->dst" → payload bytes moved in or out of the pool."""

    num_slots: int
    slot_bytes: int
    num_blocks: int
    num_hits: int
    num_evicted: int
    num_corrupt: int
    num_dropped: int
    copied_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes


@dataclass
class _Entry:
    key: bytes
    slot: int
    crc: int | None = None  # None while filling
    num_pins: int = 0


class HostBlockPool:
    """Key → slot of canonical block payloads in host memory, LRU (see the module docstring).

    Contract (each method says whether it mutates): a key maps to at most one slot and a slot
    holds at most one key; only ready, unpinned keys are on the LRU and only they are evicted;
    used + free slots = capacity.
    """

    def __init__(self, config: HostPoolConfig) -> None:
        self.config = config
        self._slots_per_chunk = max(1, _CHUNK_BYTES // config.slot_bytes)
        self._chunks: list[Tensor] = []
        self._free: list[int] = []  # released slot ids (memory allocated)
        self._num_new = 0  # slot ids handed out at least once
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # ready, unpinned; oldest first
        self._fills: list[tuple[CopyHandle, list[bytes]]] = []
        self._pins: list[tuple[CopyHandle, list[_Entry]]] = []
        self._doomed: set[int] = set()  # slots of dropped keys a copy still reads
        self._num_hits = self._num_evicted = self._num_corrupt = self._num_dropped = 0
        self._copied: dict[str, int] = {}

    # ---------------------------------------------------------------- queries (no mutation)

    @property
    def payload_len(self) -> int:
        return self.config.payload_len

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are ready in the pool (checksums are checked by `read`)."""
        for n, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or entry.crc is None:
                return n
        return len(keys)

    def contains(self, key: bytes) -> bool:
        """Whether `key` is held (ready or filling)."""
        return key in self._entries

    def is_filling(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.crc is None

    def stats(self) -> HostPoolStats:
        return HostPoolStats(
            num_slots=self.config.num_slots,
            slot_bytes=self.config.slot_bytes,
            num_blocks=len(self._entries),
            num_hits=self._num_hits,
            num_evicted=self._num_evicted,
            num_corrupt=self._num_corrupt,
            num_dropped=self._num_dropped,
            copied_bytes=dict(self._copied),
        )

    # ---------------------------------------------------------------- mutations

    def put(
        self,
        keys: Sequence[bytes],
        copy: Callable[[list[int], list[Tensor]], CopyHandle],
        source: str,
    ) -> None:
        """Store the blocks of `keys` (a chain segment, in order) that the pool lacks.

        Mutates: takes a slot for each missing key (evicting LRU keys when none is free; a key
        that finds no slot is dropped, counted, and so are the keys after it) and calls
        `copy(indices into keys, slot payload views)` to issue the copies into them; the keys
        are filling until the handle it returns is done (`poll`). The keys already held become
        the most recently used first, so making room never evicts the segment's own parents.
        """
        self.touch(keys)
        indices, views, taken = [], [], []
        for i, key in enumerate(keys):
            if key in self._entries:
                continue
            slot = self._take_slot()
            if slot is None:
                self._num_dropped += len(keys) - i
                break
            self._entries[key] = _Entry(key, slot)
            indices.append(i)
            views.append(self._view(slot))
            taken.append(key)
        if not taken:
            return
        try:
            handle = copy(indices, views)
        except BaseException:
            for key in taken:
                self._release(key)
            raise
        self._count(f"{source}->host", len(taken))
        self._fills.append((handle, taken))
        self.poll()

    def put_bytes(self, key: bytes, payload: bytes, source: str) -> None:
        """Store a payload given as bytes (a block read from a directory tier); no-op when the
        key is held or no slot is free. Raises ValueError for a wrong length."""
        if len(payload) != self.payload_len:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_len}")

        def copy(_: list[int], views: list[Tensor]) -> CopyHandle:
            import torch  # (the scheduler imports this module: it stays torch-free)

            views[0].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            return DONE

        self.put([key], copy, source)

    def read(self, keys: Sequence[bytes]) -> list[Tensor]:
        """Slot payload views of the longest prefix of `keys` that is ready and intact.

        Mutates: a key whose slot fails its checksum is dropped (counted; the read stops
        there); the keys read become the most recently used (parents after children, so
        leaves are evicted first). The caller copies out of the views and calls `pin` with
        the copy's handle before anything else can take a slot."""
        views = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.crc is None:
                break
            view = self._view(entry.slot)
            if _crc(view) != entry.crc:
                self._num_corrupt += 1
                self._drop(key)
                break
            views.append(view)
        self.touch(keys[: len(views)])
        return views

    def pin(self, keys: Sequence[bytes], handle: CopyHandle, destination: str = "gpu") -> None:
        """A copy out of the slots of `keys` (just `read`) is in flight until `handle` is done:
        the slots are not evicted before that. Counts the blocks as hits."""
        entries = [self._entries[k] for k in keys if k in self._entries]
        self._num_hits += len(entries)
        self._count(f"host->{destination}", len(entries))
        for entry in entries:
            entry.num_pins += 1
            self._lru.pop(entry.key, None)
        self._pins.append((handle, entries))
        self.poll()

    def payload(self, key: bytes, destination: str = "dir") -> bytes | None:
        """The payload bytes of a ready, intact key (a directory write-back writes exactly
        these), else None. Mutates only by dropping a corrupt slot (counted)."""
        entry = self._entries.get(key)
        if entry is None or entry.crc is None:
            return None
        data = self._view(entry.slot).numpy().tobytes()
        if zlib.crc32(data) != entry.crc:
            self._num_corrupt += 1
            self._drop(key)
            return None
        self._count(f"host->{destination}", 1)
        return data

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make the ready, unpinned ones of `keys` (a chain segment) the most recently used,
        deepest first (so among them the leaves are evicted first)."""
        for key in reversed(keys):
            if key in self._lru:
                self._lru.move_to_end(key)

    def poll(self) -> None:
        """Finish the copies that are done: filled keys get their checksum and join the LRU;
        pins are released. Never waits."""
        if self._fills:
            pending = []
            for handle, keys in self._fills:
                if not handle.is_done():
                    pending.append((handle, keys))
                    continue
                for key in reversed(keys):
                    entry = self._entries.get(key)
                    if entry is not None and entry.crc is None:
                        entry.crc = _crc(self._view(entry.slot))
                        if entry.num_pins == 0:
                            self._lru[key] = None
            self._fills = pending
        if self._pins:
            pending = []
            for handle, entries in self._pins:
                if not handle.is_done():
                    pending.append((handle, entries))
                    continue
                for entry in reversed(entries):
                    entry.num_pins -= 1
                    if entry.num_pins:
                        continue
                    if entry.slot in self._doomed:
                        self._doomed.discard(entry.slot)
                        self._free.append(entry.slot)
                    elif entry.crc is not None:
                        self._lru[entry.key] = None
            self._pins = pending

    def wait(self) -> None:
        """Block until every copy in flight is done, then `poll` (shutdown, tests)."""
        for handle, _ in self._fills + self._pins:
            handle.wait()
        self.poll()

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` least recently used ready, unpinned keys; returns how many
        were evicted. Filling and pinned keys are never evicted."""
        num = 0
        while self._lru and num < num_blocks:
            key, _ = self._lru.popitem(last=False)
            self._release(key)
            num += 1
        self._num_evicted += num
        return num

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant. No mutation.

        Invariants: keys ↔ slots is a bijection; used + free slots = capacity; the LRU holds
        exactly the ready, unpinned keys; pins are never negative; held bytes ≤ budget.
        """
        slots = [e.slot for e in self._entries.values()] + list(self._doomed)
        _require(len(set(slots)) == len(slots), "a slot holds two keys")
        _require(not set(slots) & set(self._free), "a slot is both used and free")
        _require(len(set(self._free)) == len(self._free), "a slot is free twice")
        _require(
            len(slots) + len(self._free) == self._num_new <= self.config.num_slots,
            f"slots do not add up: {len(slots)} used or doomed + {len(self._free)} free != "
            f"{self._num_new} handed out (capacity {self.config.num_slots})",
        )
        for key, entry in self._entries.items():
            _require(entry.num_pins >= 0, f"slot {entry.slot} has {entry.num_pins} pins")
            on_lru = entry.crc is not None and entry.num_pins == 0
            _require((key in self._lru) == on_lru, f"slot {entry.slot}'s LRU membership is wrong")
        _require(len(self._lru) <= len(self._entries), "the LRU holds a key the pool lacks")
        _require(
            len(self._entries) * self.config.slot_bytes <= self.config.max_bytes,
            "held bytes exceed the budget",
        )

    # ---------------------------------------------------------------- helpers

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._num_new < self.config.num_slots:
            slot = self._num_new
            if slot // self._slots_per_chunk == len(self._chunks):
                self._chunks.append(self._new_chunk(slot))
            self._num_new += 1
            return slot
        if self.evict(1):
            return self._free.pop()
        return None

    def _new_chunk(self, first_slot: int) -> Tensor:
        import torch  # (the scheduler imports this module: it stays torch-free)

        num = min(self._slots_per_chunk, self.config.num_slots - first_slot)
        return torch.zeros(
            num, self.config.slot_bytes, dtype=torch.uint8, pin_memory=self.config.pin_memory
        )

    def _view(self, slot: int) -> Tensor:
        chunk = self._chunks[slot // self._slots_per_chunk]
        return chunk[slot % self._slots_per_chunk, : self.payload_len]

    def _drop(self, key: bytes) -> None:
        """Forget a ready key (a corrupt slot); a slot a copy still reads is freed when its
        pin is released (`poll`)."""
        entry = self._entries[key]
        if entry.num_pins == 0:
            self._release(key)
        else:
            del self._entries[key]
            self._doomed.add(entry.slot)

    def _release(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._lru.pop(key, None)
        self._free.append(entry.slot)

    def _count(self, route: str, num_blocks: int) -> None:
        if num_blocks:
            self._copied[route] = self._copied.get(route, 0) + num_blocks * self.payload_len


def default_host_bytes(num_local_ranks: int = 1) -> int:
    """`DEFAULT_HOST_FRACTION` of the memory available now, split between the machine's
    engine ranks (0 where the kernel does not report it)."""
    return int(_available_memory() * DEFAULT_HOST_FRACTION) // max(1, num_local_ranks)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _crc(view: Tensor) -> int:
    return zlib.crc32(view.numpy())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"HostBlockPool integrity: {message}")
