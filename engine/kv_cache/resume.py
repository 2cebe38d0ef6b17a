"""Resume slots: the private state of finished sequences, kept in host memory (`cache.md` §3).

A block hit restores only the global KV of whole 128-token blocks; a sequence's window rings,
ratio-2 pending pairs, token history and the KV of its partial last block are what the next
turn of an agent (the same tokens, then new ones) would otherwise rebuild by replay. A resume
slot is a snapshot of exactly that, taken when the sequence finishes:

    tokens     0 .................... P0 ........ L | new tokens of the next turn ... S
    restored   [ cached blocks (GPU tier)  ][ slot ]
    computed                                        [ only these ]

    P0 = 128·⌊L/128⌋; L = the positions the sequence computed (its last sampled token is not
    one of them; the next turn's prompt holds it at L and computes it)

The pool is pure Python: it indexes slots by the chain key at P0 (the chain seed when P0 = 0,
so the salt and the namespace are in every key) and the tail token ids [P0, L), and keeps the
payloads (opaque host buffers the runner writes and reads, `SlotPayload`) within a byte budget,
evicting the least recently used unreferenced slot first. A slot is referenced while a request
admitted from it has not yet had its first chunk applied (the runner copies it back at that
chunk), so eviction never takes a payload a scheduled step still reads.

Exactness: a slot's payload is the one state the old sequence had at L, so the resumed
request computes what the old sequence would have computed had it continued. A slot whose
checksum no longer matches its payload is dropped at lookup: a miss, never wrong output. The
checksum is taken once the snapshot's device → host copy has landed (at publish on the CPU;
on CUDA at the first `seal` after the copy's event, so a finish never waits for the device).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from engine.kv_cache.hashing import KEY_BYTES
from engine.kv_cache.resume_dir import FetchedSlot, RemoteSlots, SlotPointer
from engine.outputs import SlotRestore
from engine.request import Request


class SlotPayload(Protocol):
    """A snapshot's bytes in host memory (the runner's `RunnerSlotPayloads` makes them)."""

    @property
    def nbytes(self) -> int: ...

    def checksum(self) -> int:
        """CRC-32 of the bytes now (waits for an asynchronous device copy to land)."""
        ...

    def is_ready(self) -> bool:
        """Whether the bytes have landed (`checksum` would not wait)."""
        ...

    def to_bytes(self) -> bytes:
        """The bytes (waits for the copy), for a pull by another server."""
        ...


@dataclass
class ResumeSlot:
    """One snapshot. `boundary_key`: the chain key at `num_boundary_tokens` (P0);
    `tail_token_ids`: the tokens of [P0, L); `generation`: unique per publish, so a reused
    slot id never answers for an older one; `checksum`: CRC-32 of the payload once its copy
    landed (None until `ResumeSlots.seal` took it)."""

    slot_id: int
    generation: int
    boundary_key: bytes
    num_boundary_tokens: int
    tail_token_ids: tuple[int, ...]
    payload: SlotPayload
    checksum: int | None
    num_refs: int = 0

    @property
    def length(self) -> int:
        """L: the positions the snapshot restores."""
        return self.num_boundary_tokens + len(self.tail_token_ids)

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


@dataclass(frozen=True)
class ResumeSlotStats:
    """num_slots / num_bytes: held now (max_bytes: the budget); the rest count since start:
    hits and misses of admitted requests, slots dropped for a checksum mismatch, slots evicted
    for room, snapshots published and snapshots refused (larger than the whole budget)."""

    num_slots: int
    num_bytes: int
    max_bytes: int
    num_hits: int = 0
    num_misses: int = 0
    num_corrupt: int = 0
    num_evicted: int = 0
    num_published: int = 0
    num_refused: int = 0


class ResumeSlots:
    """The resume-slot pool of one engine: index, LRU and byte budget.

    Contract (each method says whether it mutates): every held slot is in the index under its
    (boundary key, tail) and on the LRU; at most one slot per (boundary key, tail); the bytes
    held never exceed `max_bytes`; a referenced slot is never evicted. Not thread-safe: one
    owner (the scheduler's `PrefixReuse`) calls it from the engine thread.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._by_key: dict[bytes, dict[tuple[int, ...], ResumeSlot]] = {}
        self._lru: OrderedDict[int, ResumeSlot] = OrderedDict()  # slot id → slot, oldest first
        self._unsealed: dict[int, ResumeSlot] = {}  # slot id → slot whose checksum is None
        self._removed: list[ResumeSlot] = []  # removed since the last `take_removed`
        self._num_bytes = 0
        self._next_id = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "evicted", "published", "refused"), 0
        )

    # ---------------------------------------------------------------- queries (no mutation)

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, slot_id: int, generation: int) -> ResumeSlot | None:
        """The held slot with this id and generation, or None. No mutation; safe to call from
        another thread than the owner's (one dict read)."""
        slot = self._lru.get(slot_id)
        return slot if slot is not None and slot.generation == generation else None

    def slots(self) -> Iterator[ResumeSlot]:
        """The held slots, least recently used first."""
        return iter(list(self._lru.values()))

    def lookup(
        self, boundary_key: bytes, tokens_after: Sequence[int], max_tail_len: int
    ) -> list[ResumeSlot]:
        """The slots under `boundary_key` whose tail is a prefix of `tokens_after` (the
        request's tokens from P0 on) and at most `max_tail_len` long, longest first. No
        mutation (the checksum is checked by `verify`)."""
        found = [
            slot
            for tail, slot in self._by_key.get(boundary_key, {}).items()
            if len(tail) <= max_tail_len and tuple(tokens_after[: len(tail)]) == tail
        ]
        return sorted(found, key=lambda slot: -len(slot.tail_token_ids))

    def stats(self) -> ResumeSlotStats:
        c = self._counts
        return ResumeSlotStats(
            num_slots=len(self._lru),
            num_bytes=self._num_bytes,
            max_bytes=self.max_bytes,
            num_hits=c["hits"],
            num_misses=c["misses"],
            num_corrupt=c["corrupt"],
            num_evicted=c["evicted"],
            num_published=c["published"],
            num_refused=c["refused"],
        )

    # ---------------------------------------------------------------- mutations

    def publish(
        self,
        boundary_key: bytes,
        num_boundary_tokens: int,
        tail_token_ids: Sequence[int],
        payload: SlotPayload,
        checksum: int | None,
    ) -> ResumeSlot | None:
        """Hold a new snapshot; it replaces a slot with the same (boundary key, tail) unless
        that one is referenced (then the new one is refused). Evicts least recently used
        unreferenced slots until it fits. Returns the slot, or None (counted as refused) when
        it cannot fit: larger than the budget, or the rest is referenced. `checksum` None: the
        payload's copy is still running; `seal` takes it later."""
        if len(boundary_key) != KEY_BYTES:
            raise ValueError(f"boundary_key must be {KEY_BYTES} bytes")
        tail = tuple(tail_token_ids)
        old = self._by_key.get(boundary_key, {}).get(tail)
        if old is not None:
            if old.num_refs:
                self._counts["refused"] += 1
                return None
            self._remove(old)
        if not self._make_room(payload.nbytes):
            self._counts["refused"] += 1
            return None
        slot = ResumeSlot(
            slot_id=self._next_id,
            generation=self._next_id,
            boundary_key=boundary_key,
            num_boundary_tokens=num_boundary_tokens,
            tail_token_ids=tail,
            payload=payload,
            checksum=checksum,
        )
        self._next_id += 1
        self._by_key.setdefault(boundary_key, {})[tail] = slot
        self._lru[slot.slot_id] = slot
        if checksum is None:
            self._unsealed[slot.slot_id] = slot
        self._num_bytes += slot.nbytes
        self._counts["published"] += 1
        return slot

    def seal(self) -> None:
        """Take the checksum of every slot whose copy has landed since its publish (never
        waits). Mutates only those slots' `checksum`."""
        for slot in list(self._unsealed.values()):
            if slot.payload.is_ready():
                slot.checksum = slot.payload.checksum()
                del self._unsealed[slot.slot_id]

    def verify(self, slot: ResumeSlot) -> bool:
        """Whether the payload still has its checksum (a slot not sealed yet is sealed now:
        waits for its copy). Mutates: a slot that fails is dropped (counted corrupt) unless
        referenced; a slot that passes becomes the most recent."""
        if slot.checksum is None:
            slot.checksum = slot.payload.checksum()
            self._unsealed.pop(slot.slot_id, None)
        if slot.payload.checksum() == slot.checksum:
            self._lru.move_to_end(slot.slot_id)
            return True
        self._counts["corrupt"] += 1
        if not slot.num_refs:
            self._remove(slot)
        return False

    def lock(self, slot: ResumeSlot) -> None:
        """A request was admitted from the slot (counted as a hit): it stays until `unlock`."""
        slot.num_refs += 1
        self._counts["hits"] += 1

    def unlock(self, slot: ResumeSlot) -> None:
        """The request no longer needs the slot (its restore ran, or it left before)."""
        if slot.num_refs <= 0:
            raise ValueError(f"resume slot {slot.slot_id} is not referenced")
        slot.num_refs -= 1

    def record_miss(self) -> None:
        """An admitted request found no usable slot."""
        self._counts["misses"] += 1

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant. No mutation."""
        indexed = [s for tails in self._by_key.values() for s in tails.values()]
        _require(len(indexed) == len(self._lru), "index and LRU sizes differ")
        for slot in indexed:
            _require(self._lru.get(slot.slot_id) is slot, f"slot {slot.slot_id} not on the LRU")
            _require(slot.num_refs >= 0, f"slot {slot.slot_id} has {slot.num_refs} refs")
        _require(self._num_bytes == sum(s.nbytes for s in indexed), "held bytes do not add up")
        _require(self._num_bytes <= self.max_bytes, "held bytes exceed the budget")
        _require(
            self._unsealed.keys() == {s.slot_id for s in indexed if s.checksum is None},
            "the unsealed slots are not those without a checksum",
        )

    # ---------------------------------------------------------------- helpers

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        free = self.max_bytes - self._num_bytes
        victims = []
        for slot in self._lru.values():
            if free >= nbytes:
                break
            if not slot.num_refs:
                victims.append(slot)
                free += slot.nbytes
        if free < nbytes:
            return False
        for slot in victims:
            self._remove(slot)
            self._counts["evicted"] += 1
        return True

    def _remove(self, slot: ResumeSlot) -> None:
        tails = self._by_key[slot.boundary_key]
        del tails[slot.tail_token_ids]
        if not tails:
            del self._by_key[slot.boundary_key]
        del self._lru[slot.slot_id]
        self._unsealed.pop(slot.slot_id, None)
        self._num_bytes -= slot.nbytes
        self._removed.append(slot)

    def take_removed(self) -> list[ResumeSlot]:
        """The slots removed (evicted, replaced, corrupt) since the last call. Mutates: clears
        that list."""
        removed, self._removed = self._removed, []
        return removed


class SlotPayloads(Protocol):
    """The runner's snapshot of a state slot (and the partial last block) to host memory."""

    def export(self, slot: int, tail_block: int | None) -> SlotPayload: ...

    def from_bytes(self, data: bytes) -> SlotPayload:
        """A payload pulled from another server (`SlotPayload.to_bytes` there)."""
        ...


@dataclass
class _Fetch:
    future: Future[FetchedSlot | None]
    deadline: float


class ResumeTier:
    """What `PrefixReuse` does with resume slots for one request: find one at admission, hand
    its payload to the first chunk, release it, and snapshot a finished sequence.

    The request's `resume_slot` is the slot it was admitted from until that slot's restore
    has run (its first chunk was applied) or it left (preempted, aborted, finished)."""

    def __init__(
        self,
        pool: ResumeSlots,
        payloads: SlotPayloads,
        block_tokens: int,
        remote: RemoteSlots | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """remote: other servers' slots through the shared directory (`resume_dir.py`; None:
        this process's slots only); clock: monotonic seconds for a pull's deadline."""
        self.pool = pool
        self.payloads = payloads
        self.block_tokens = block_tokens
        self.remote = remote
        self.clock = clock
        self._fetches: dict[str, _Fetch] = {}  # waiting request id → its pull
        self._settled: set[str] = set()  # waiting requests whose pull is over
        self._announced: set[int] = set()  # slot ids with a pointer file

    def is_ready(self, request: Request, keys: Sequence[bytes], seed: bytes) -> bool:
        """Whether a waiting request may be admitted as far as slots are concerned: always
        without `remote` or with a local slot; else the first call starts a pull of another
        server's slot on the worker thread and the request waits until it is over (a pulled
        slot joins this pool) or `remote.timeout_s` passed. Nothing here waits on I/O."""
        rid = request.request_id
        if self.remote is None or rid in self._settled:
            return True
        fetch = self._fetches.get(rid)
        if fetch is None:
            if self.find(request, keys, seed, len(keys)) is not None:
                self._settled.add(rid)
                return True
            bt = self.block_tokens
            boundaries = [(seed, 0), *((k, (i + 1) * bt) for i, k in enumerate(keys))]
            future = self.remote.start_fetch(boundaries, request.all_token_ids)
            self._fetches[rid] = _Fetch(future, self.clock() + self.remote.timeout_s)
            return False
        if not fetch.future.done() and self.clock() < fetch.deadline:
            return False
        self._settled.add(rid)
        fetched = fetch.future.result() if fetch.future.done() else None
        if fetched is not None:
            pointer = fetched.pointer
            payload = self.payloads.from_bytes(fetched.payload)
            self.pool.publish(
                fetched.boundary_key,
                pointer.num_boundary_tokens,
                pointer.tail_token_ids,
                payload,
                pointer.checksum,
            )
        return True

    def forget_wait(self, request: Request) -> None:
        """The request left the queue: drop its pull."""
        fetch = self._fetches.pop(request.request_id, None)
        if fetch is not None:
            fetch.future.cancel()
        self._settled.discard(request.request_id)

    def find(
        self, request: Request, keys: Sequence[bytes], seed: bytes, num_gpu_blocks: int
    ) -> ResumeSlot | None:
        """The longest verified slot the request's tokens extend by at least one token, whose
        boundary blocks are all in the GPU tier (`keys[:num_gpu_blocks]` matched). Mutates
        only by dropping corrupt slots (`ResumeSlots.verify`)."""
        self.pool.seal()
        tokens, bt = request.all_token_ids, self.block_tokens
        for num_blocks in range(min(num_gpu_blocks, len(keys)), -1, -1):
            boundary = keys[num_blocks - 1] if num_blocks else seed
            start = num_blocks * bt
            for slot in self.pool.lookup(boundary, tokens[start:], len(tokens) - 1 - start):
                if self.pool.verify(slot):
                    return slot
        return None

    def admit(self, request: Request, slot: ResumeSlot | None) -> None:
        """The request was admitted from `slot` (a hit: referenced until applied) or from no
        slot (a miss)."""
        if slot is None:
            self.pool.record_miss()
            return
        self.pool.lock(slot)
        request.resume_slot = slot

    def restore(
        self, request: Request, start: int, block_table: Sequence[int]
    ) -> SlotRestore | None:
        """What the chunk starting at `start` copies back: the slot of a request admitted
        from one, for its first chunk (which starts at the slot's L); else None."""
        slot = request.resume_slot
        if slot is None or start != slot.length:
            return None
        has_tail = bool(slot.tail_token_ids)
        tail_block = (
            block_table[slot.num_boundary_tokens // self.block_tokens] if has_tail else None
        )
        return SlotRestore(slot.payload, tail_block)

    def applied(self, request: Request) -> None:
        """A chunk of the request was applied: once it computed past L, the slot is free."""
        slot = request.resume_slot
        if slot is not None and request.num_computed_tokens > slot.length:
            self.drop(request)

    def drop(self, request: Request) -> None:
        """The request holds its slot no longer (applied, preempted, aborted or finished)."""
        if request.resume_slot is not None:
            self.pool.unlock(request.resume_slot)
            request.resume_slot = None

    def retire(
        self, request: Request, keys: Sequence[bytes], seed: bytes, slot: int, table: Sequence[int]
    ) -> ResumeSlot | None:
        """Snapshot a sequence that finished holding state `slot` and `table`: at L =
        `num_computed_tokens` (blocks [0, P0) must be indexed or computed). Returns the slot
        published, or None (nothing computed, or the pool refused it)."""
        length, bt = request.num_computed_tokens, self.block_tokens
        num_blocks = length // bt
        if length == 0 or len(keys) < num_blocks:
            return None
        boundary = keys[num_blocks - 1] if num_blocks else seed
        tail_block = table[num_blocks] if length > num_blocks * bt else None
        payload = self.payloads.export(slot, tail_block)
        tail = request.all_token_ids[num_blocks * bt : length]
        self.pool.seal()
        checksum = payload.checksum() if payload.is_ready() else None
        published = self.pool.publish(boundary, num_blocks * bt, tail, payload, checksum)
        self._sync_pointers()
        return published

    def _sync_pointers(self) -> None:
        """Announce sealed slots in the shared directory and retract removed ones (on the
        remote's worker thread)."""
        if self.remote is None:
            self.pool.take_removed()
            return
        removed = [s for s in self.pool.take_removed() if s.slot_id in self._announced]
        new = [
            s
            for s in self.pool.slots()
            if s.checksum is not None and s.slot_id not in self._announced
        ]
        for slot in removed:
            self._announced.discard(slot.slot_id)
        self._announced.update(s.slot_id for s in new)
        owner = self.remote.directory.owner
        self.remote.announce(
            [(s.boundary_key, _pointer(s, owner)) for s in new],
            [(s.boundary_key, _pointer(s, owner)) for s in removed],
        )


def _pointer(slot: ResumeSlot, owner: str) -> SlotPointer:
    assert slot.checksum is not None
    return SlotPointer(
        owner=owner,
        slot_id=slot.slot_id,
        generation=slot.generation,
        num_boundary_tokens=slot.num_boundary_tokens,
        tail_token_ids=slot.tail_token_ids,
        nbytes=slot.nbytes,
        checksum=slot.checksum,
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"ResumeSlots integrity: {message}")
