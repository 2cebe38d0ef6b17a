"""Pointer files of resume slots in a shared directory and pulls over HTTP (`resume_dir.py`):
lookups see other servers' pointers only, skip unreadable files, retract only their own; a
pull from a server that is gone is a miss (the slot route: `test_resume_slots_live.py`)."""

from __future__ import annotations

import zlib

from engine.distributed.groups import free_port
from engine.kv_cache.resume_dir import PointerDirectory, RemoteSlots, SlotPointer

KEY = bytes(range(32))


def pointer(owner: str, slot_id: int, tail: tuple[int, ...], data: bytes = b"x") -> SlotPointer:
    return SlotPointer(owner, slot_id, slot_id, 128, tail, len(data), zlib.crc32(data))


def test_lookup_sees_other_owners_longest_first_and_skips_bad_files(tmp_path) -> None:
    mine, theirs = PointerDirectory(tmp_path, "http://a"), PointerDirectory(tmp_path, "http://b")
    mine.publish(KEY, pointer("http://a", 1, (5,)))
    theirs.publish(KEY, pointer("http://b", 2, (5,)))  # the same sequence: the newest wins
    theirs.publish(KEY, pointer("http://b", 3, (5, 6, 7)))
    folder = next((tmp_path / "resume").rglob("*.ptr")).parent
    (folder / "junk.ptr").write_text("{not json")
    found = mine.lookup(KEY, [5, 6, 7, 8], 10)
    assert [p.slot_id for p in found] == [3, 2]
    assert [p.slot_id for p in mine.lookup(KEY, [5, 6, 7], 2)] == [2]  # one token left over
    assert theirs.lookup(bytes(32), [5], 10) == []
    mine.retract(KEY, pointer("http://a", 1, (5,)))  # the file now names b's slot 2
    assert [p.slot_id for p in mine.lookup(KEY, [5, 6], 5)] == [2]
    theirs.retract(KEY, pointer("http://b", 2, (5,)))
    assert [p.slot_id for p in mine.lookup(KEY, [5, 6, 7, 8], 5)] == [3]


def test_a_pull_from_a_dead_owner_is_a_miss(tmp_path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    PointerDirectory(tmp_path, dead).publish(KEY, pointer(dead, 1, (5,)))
    remote = RemoteSlots(PointerDirectory(tmp_path, "http://me"), timeout_s=2.0)
    assert remote.start_fetch([(KEY, 128)], [0] * 128 + [5, 6]).result(timeout=10) is None
    assert remote.num_failed == 1
    remote.close()
