"""Resume slots across processes (`cache.md` §3.4, backend 2): pointer files in the shared cache
directory name the server holding a slot, which serves its bytes over HTTP.

    <shared dir>/resume/<k0k1>/<boundary key hex>/<tail digest>.ptr     JSON, one per slot

A server publishes a pointer for every slot it holds (temp file + `os.replace`: the newest
holder of one (boundary, tail) wins) and removes its own pointers when it evicts the slot. A
server missing a slot locally lists the pointer directories of the request's block
boundaries, and pulls the longest matching slot from its owner
(`GET <owner>/internal/kv/slot/<id>?generation=<g>`): the owner answers only for the exact
(id, generation), and the puller checks the length and CRC-32 the pointer promised. A missing,
dead or stale owner, an unreadable pointer or a failed check is a miss, never wrong output:
the request then goes on with block hits (bounded or exact replay).

All of it runs on a worker thread (`RemoteSlots.start_fetch`); the engine thread only polls.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class SlotPointer:
    """What a pointer file says: the owner's base URL, the slot's (id, generation), its
    boundary P0 and tail token ids, and the payload's length and CRC-32."""

    owner: str
    slot_id: int
    generation: int
    num_boundary_tokens: int
    tail_token_ids: tuple[int, ...]
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class FetchedSlot:
    """A slot pulled from its owner: the pointer and the verified payload bytes."""

    boundary_key: bytes
    pointer: SlotPointer
    payload: bytes


class PointerDirectory:
    """The pointer files under `<root>/resume` (see the module docstring). Thread-safe: every
    call is a few file operations; nothing is cached."""

    def __init__(self, root: str | Path, owner: str) -> None:
        self.root = Path(root) / "resume"
        self.owner = owner.rstrip("/")

    def publish(self, boundary_key: bytes, pointer: SlotPointer) -> None:
        """Write (or replace) the pointer of a slot this server holds. Raises OSError."""
        path = self._path(boundary_key, pointer.tail_token_ids)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        temp.write_text(
            json.dumps(pointer.__dict__ | {"tail_token_ids": list(pointer.tail_token_ids)})
        )
        os.replace(temp, path)

    def retract(self, boundary_key: bytes, pointer: SlotPointer) -> None:
        """Remove the pointer if it still names this slot (another owner's stays)."""
        path = self._path(boundary_key, pointer.tail_token_ids)
        current = _read(path)
        if current is not None and (current.owner, current.slot_id) == (
            self.owner,
            pointer.slot_id,
        ):
            path.unlink(missing_ok=True)

    def lookup(
        self, boundary_key: bytes, tokens_after: Sequence[int], max_tail_len: int
    ) -> list[SlotPointer]:
        """Other servers' pointers under `boundary_key` whose tail is a prefix of
        `tokens_after` and at most `max_tail_len` long, longest first. Unreadable files are
        skipped."""
        folder = self._path(boundary_key, ()).parent
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        found = []
        for name in names:
            if not name.endswith(".ptr"):
                continue
            pointer = _read(folder / name)
            if pointer is None or pointer.owner == self.owner:
                continue
            tail = pointer.tail_token_ids
            if len(tail) <= max_tail_len and tuple(tokens_after[: len(tail)]) == tail:
                found.append(pointer)
        return sorted(found, key=lambda p: -len(p.tail_token_ids))

    def _path(self, boundary_key: bytes, tail: Sequence[int]) -> Path:
        key = boundary_key.hex()
        digest = hashlib.sha256(json.dumps(list(tail)).encode()).hexdigest()[:32]
        return self.root / key[:2] / key / f"{digest}.ptr"


class RemoteSlots:
    """Finds and pulls other servers' slots for waiting requests, on one worker thread."""

    def __init__(self, directory: PointerDirectory, timeout_s: float = 2.0) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resume-pull")
        self.num_pulled = 0
        self.num_failed = 0

    def start_fetch(
        self, boundaries: Sequence[tuple[bytes, int]], tokens: Sequence[int]
    ) -> Future[FetchedSlot | None]:
        """Pull the longest slot the tokens extend from any of `boundaries` ((key, P0)
        pairs), deepest first; the future's result is None when none could be pulled."""
        tokens = tuple(tokens)
        return self._pool.submit(self._fetch, list(boundaries), tokens)

    def announce(
        self,
        published: Sequence[tuple[bytes, SlotPointer]],
        removed: Sequence[tuple[bytes, SlotPointer]],
    ) -> None:
        """Write the pointers of new slots and remove those of removed ones, in the
        background (a failed write only means other servers miss the slot)."""
        if published or removed:
            self._pool.submit(self._announce, list(published), list(removed))

    def _announce(self, published, removed) -> None:
        for key, pointer in removed:
            with contextlib.suppress(OSError):
                self.directory.retract(key, pointer)
        for key, pointer in published:
            with contextlib.suppress(OSError):
                self.directory.publish(key, pointer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, boundaries: list[tuple[bytes, int]], tokens: tuple[int, ...]):
        for key, start in sorted(boundaries, key=lambda b: -b[1]):
            for pointer in self.directory.lookup(key, tokens[start:], len(tokens) - 1 - start):
                payload = self._pull(pointer)
                if payload is not None:
                    self.num_pulled += 1
                    return FetchedSlot(key, pointer, payload)
                self.num_failed += 1
        return None

    def _pull(self, pointer: SlotPointer) -> bytes | None:
        url = f"{pointer.owner}/internal/kv/slot/{pointer.slot_id}"
        try:
            response = httpx.get(
                url, params={"generation": pointer.generation}, timeout=self.timeout_s
            )
        except httpx.HTTPError:
            return None  # a dead or unreachable owner
        data = response.content
        if response.status_code != 200 or len(data) != pointer.nbytes:
            return None
        return data if zlib.crc32(data) == pointer.checksum else None


def _read(path: Path) -> SlotPointer | None:
    try:
        fields = json.loads(path.read_text())
        fields["tail_token_ids"] = tuple(fields["tail_token_ids"])
        return SlotPointer(**fields)
    except (OSError, ValueError, TypeError, KeyError):
        return None
