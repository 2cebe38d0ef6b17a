"""The directory block store: format, publish, validation, faults, TTL and GC
(`cache.md` §2.4, §6.2, §6.4), on temp directories with an injected clock."""

from __future__ import annotations

import hashlib
import os
import random
import time

import pytest

from engine.kv_cache.hashing import block_key, chain_seed
from engine.kv_cache.store import format as fmt
from engine.kv_cache.store.dirstore import DirBlockStore, DirStoreConfig
from engine.kv_cache.store.ttl import TTLPolicy
from tests.engine.store.faults import EIO, ENOSPC, ESTALE, FaultyOps, SimulatedCrash

DAY = 86400.0
PAYLOAD = 1000
FINGERPRINT = hashlib.sha256(b"namespace A").digest()


class Clock:
    def __init__(self, now: float = 1.9e9) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def payload_of(key: bytes) -> bytes:
    """Deterministic payload per key, so any wrong byte is detectable."""
    return random.Random(key).randbytes(PAYLOAD)


def chain(num_blocks: int, seed_text: str = "p", fingerprint: bytes = FINGERPRINT):
    seed = chain_seed(fingerprint)
    rng = random.Random(seed_text)
    blocks, parent = [], seed
    for depth in range(num_blocks):
        tokens = tuple(rng.randrange(100000) for _ in range(16))
        key = block_key(parent, tokens)
        blocks.append(fmt.BlockIdentity(fingerprint[:16], key, parent, depth, tokens))
        parent = key
    return blocks


def make_store(tmp_path, clock=None, ops=None, fingerprint=FINGERPRINT, **overrides):
    settings = {"max_bytes": 1 << 30, "min_free_bytes": 0, **overrides}
    config = DirStoreConfig(root=str(tmp_path), tier="local", **settings)
    return DirBlockStore(
        config,
        fingerprint=fingerprint,
        namespace_fields={"test": fingerprint.hex()},
        payload_len=PAYLOAD,
        policy=TTLPolicy(),
        ops=ops or FaultyOps(),
        clock=clock or Clock(),
    )


def write_chain(store, blocks, traffic_class="chat") -> None:
    for block in blocks:
        assert store.write(block, payload_of(block.key), traffic_class)


# ---------------------------------------------------------------- format and publish


def test_round_trip_and_layout(tmp_path) -> None:
    store = make_store(tmp_path)
    blocks = chain(3)
    write_chain(store, blocks)
    for block in blocks:
        assert store.read(block) == payload_of(block.key)
    path = store.path_of(blocks[2].key, 2)
    assert path.endswith(f"{blocks[2].key.hex()}-2.kvb")
    assert os.path.getsize(path) == 4096 + 4096  # header + payload padded to a page
    assert os.path.exists(os.path.join(store.directory, "NAMESPACE.json"))
    assert store.directory.endswith(FINGERPRINT[:16].hex())
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".tmp-")]
    store.check_integrity()
    assert store.stats().hits == 3 and store.stats().blocks_written == 3


def test_every_header_field_is_checked(tmp_path) -> None:
    block = chain(1)[0]
    data = fmt.encode(block, payload_of(block.key), 1, 2)
    assert fmt.decode(data, block, PAYLOAD) == payload_of(block.key)
    others = {
        "namespace": fmt.BlockIdentity(b"x" * 16, block.key, block.parent, 0, block.token_ids),
        "key": fmt.BlockIdentity(block.namespace, b"k" * 32, block.parent, 0, block.token_ids),
        "parent": fmt.BlockIdentity(block.namespace, block.key, b"p" * 32, 0, block.token_ids),
        "depth": fmt.BlockIdentity(block.namespace, block.key, block.parent, 1, block.token_ids),
        "tokens": fmt.BlockIdentity(block.namespace, block.key, block.parent, 0, (1,) * 16),
    }
    for reason, expected in others.items():
        with pytest.raises(fmt.BlockFormatError) as info:
            fmt.decode(data, expected, PAYLOAD)
        assert info.value.reason == reason
    for offset, reason in (
        (0, "magic"),
        (8, "version"),
        (200, "header_crc"),
        (5000, "payload_crc"),
    ):
        bad = bytearray(data)
        bad[offset] ^= 1
        with pytest.raises(fmt.BlockFormatError) as info:
            fmt.decode(bytes(bad), block, PAYLOAD)
        assert info.value.reason == reason


def test_two_writers_of_one_block_first_wins(tmp_path) -> None:
    clock = Clock()
    a, b = make_store(tmp_path, clock), make_store(tmp_path, clock)
    block = chain(1)[0]
    assert a.write(block, payload_of(block.key), "chat")
    inode = os.stat(a.path_of(block.key, 0)).st_ino
    assert b.write(block, payload_of(block.key), "chat")  # exists: only touched
    assert os.stat(a.path_of(block.key, 0)).st_ino == inode
    assert b.read(block) == payload_of(block.key)
    a.check_integrity()


def test_link_race_lost_is_a_valid_outcome(tmp_path) -> None:
    """Both writers passed the existence check; the second `link` meets EEXIST: it keeps the
    first writer's file, removes its own temp file and reports the block as stored."""
    clock = Clock()
    a, b = make_store(tmp_path, clock), make_store(tmp_path, clock)
    block = chain(1)[0]
    real_link = b.ops.link

    def link_after_a(src: str, dst: str) -> None:
        assert a.write(block, payload_of(block.key), "chat")  # a publishes first
        real_link(src, dst)

    b.ops.link = link_after_a
    assert b.write(block, payload_of(block.key), "chat")
    assert a.stats().blocks_written == 1 and b.stats().blocks_written == 0
    assert a.read(block) == payload_of(block.key)
    a.check_integrity()
    assert not [n for _, _, f in os.walk(a.directory) for n in f if n.startswith(".tmp-")]


def test_another_namespace_misses(tmp_path) -> None:
    store = make_store(tmp_path)
    block = chain(1)[0]
    write_chain(store, [block])
    other_fp = hashlib.sha256(b"namespace B").digest()
    other = make_store(tmp_path, fingerprint=other_fp)
    assert other.directory != store.directory
    moved = fmt.BlockIdentity(other_fp[:16], block.key, block.parent, 0, block.token_ids)
    assert other.read(moved) is None
    # The same file copied into the other namespace's directory: a namespace mismatch.
    os.makedirs(os.path.dirname(other.path_of(block.key, 0)), exist_ok=True)
    os.link(store.path_of(block.key, 0), other.path_of(block.key, 0))
    assert other.read(moved) is None
    assert other.stats().corrupt == {"namespace": 1}


# ---------------------------------------------------------------- read faults


@pytest.mark.parametrize(
    ("hook", "reason"),
    [
        (lambda p, d: d[:-100], "size"),
        (lambda p, d: d[:5000] + bytes([d[5000] ^ 0x40]) + d[5001:], "payload_crc"),
        (lambda p, d: bytes(len(d)), "magic"),  # zero-filled: the power-loss shape
        (lambda p, d: d[:300] + bytes([d[300] ^ 1]) + d[301:], "header_crc"),
    ],
    ids=["truncated", "flipped-payload-byte", "zero-filled", "flipped-token"],
)
def test_corrupt_file_is_a_counted_miss_and_removed(tmp_path, hook, reason) -> None:
    store = make_store(tmp_path)
    block = chain(1)[0]
    write_chain(store, [block])
    store.ops.read_hook = hook
    assert store.read(block) is None
    assert store.stats().corrupt == {reason: 1}
    assert not os.path.exists(store.path_of(block.key, 0))  # same inode: removed


def test_copied_file_of_another_block_is_a_miss(tmp_path) -> None:
    store = make_store(tmp_path)
    a, b = chain(2)
    write_chain(store, [a])
    os.makedirs(os.path.dirname(store.path_of(b.key, 1)), exist_ok=True)
    os.link(store.path_of(a.key, 0), store.path_of(b.key, 1))
    assert store.read(b) is None
    assert store.stats().corrupt == {"key": 1}
    assert store.read(a) == payload_of(a.key)


@pytest.mark.parametrize("code", [EIO, ESTALE], ids=["EIO", "ESTALE"])
def test_io_errors_on_read_are_counted_misses(tmp_path, code) -> None:
    store = make_store(tmp_path)
    block = chain(1)[0]
    write_chain(store, [block])
    store.ops.fail["read"] = code
    assert store.read(block) is None
    assert store.stats().corrupt == {"io_error": 1}
    del store.ops.fail["read"]
    assert store.read(block) == payload_of(block.key)  # the file was left alone


def test_file_deleted_between_lookup_and_read(tmp_path) -> None:
    store = make_store(tmp_path)
    block = chain(1)[0]
    write_chain(store, [block])
    assert store.contains(block.key, 0)
    store.ops.before_read = os.unlink
    assert store.read(block) is None
    assert store.stats().misses == 1 and store.stats().corrupt == {}


def test_gc_racing_a_reader(tmp_path) -> None:
    """GC unlinks after the reader opened: on a local filesystem the open file still reads;
    GC unlinks before the open: a miss. Never a wrong payload."""
    clock = Clock()
    store = make_store(tmp_path, clock, max_bytes=1)
    blocks = chain(2)
    write_chain(store, blocks)
    store.ops.before_read = lambda path: store.gc_once()
    assert store.read(blocks[0]) is None
    assert store.read(blocks[1]) is None
    assert store.stats().evicted == 2 and store.stats().hits == 0


# ---------------------------------------------------------------- write faults


def test_enospc_on_write_is_a_skipped_write(tmp_path) -> None:
    store = make_store(tmp_path)
    woken = []
    store.on_gc_needed = lambda: woken.append(1)
    block = chain(1)[0]
    store.ops.fail["write_new"] = ENOSPC
    assert store.write(block, payload_of(block.key), "chat") is False
    assert store.stats().write_errors == {"enospc": 1} and woken
    assert store.read(block) is None
    assert not [n for _, _, f in os.walk(store.directory) for n in f if n.startswith(".tmp-")]


def test_crash_between_temp_write_and_link(tmp_path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock)
    block = chain(1)[0]
    store.ops.crash_before_link = True
    with pytest.raises(SimulatedCrash):
        store.write(block, payload_of(block.key), "chat")
    temps = [n for _, _, f in os.walk(store.directory) for n in f if n.startswith(".tmp-")]
    assert len(temps) == 1
    reader = make_store(tmp_path, clock)
    assert reader.read(block) is None  # nothing was published
    reader.check_integrity()
    assert reader.gc_once().temp_removed == 0  # a writer may still be busy with it
    clock.now += 2 * 3600  # past the temp grace period: GC removes the crashed writer's file
    assert reader.gc_once().temp_removed == 1
    store.ops.crash_before_link = False
    assert store.write(block, payload_of(block.key), "chat")


def test_a_gc_of_another_process_racing_the_link_never_sees_a_block_without_its_deadline(
    tmp_path,
) -> None:
    """Another process's GC scanning right after the link must find the block's deadline
    already in place, not its creation time (which reads as expired and was deleted)."""
    clock = Clock()
    store = make_store(tmp_path, clock)
    other = make_store(tmp_path, clock)
    reports = []
    store.ops.after_link = lambda path: reports.append(other.gc_once())
    blocks = chain(3)
    assert all(store.write(b, payload_of(b.key), "chat") for b in blocks)
    assert [r.expired for r in reports] == [0, 0, 0] and all(r.ran for r in reports)
    assert store.stats().write_errors == {}
    assert all(store.read(b) == payload_of(b.key) for b in blocks)
    store.check_integrity()


# ---------------------------------------------------------------- TTL


def test_agent_blocks_expire_after_3_days_chat_after_7(tmp_path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock)
    agent, chat = chain(1, "agent")[0], chain(1, "chat")[0]
    store.write(agent, payload_of(agent.key), "agent")
    store.write(chat, payload_of(chat.key), "chat")
    clock.now += 3 * DAY - 60
    assert store.read(agent) is not None
    clock.now += 120  # 3 days + 1 minute
    assert store.read(agent) is None  # expired: never served, even before GC
    assert store.read(chat) is not None
    report = store.gc_once()
    assert report.expired == 1 and not os.path.exists(store.path_of(agent.key, 0))
    clock.now += 4 * DAY
    assert store.read(chat) is None
    assert store.stats().expired == 3  # two expired reads, one GC deletion


def test_touch_extends_never_shortens_and_is_rate_limited(tmp_path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock)
    block = chain(1)[0]
    store.write(block, payload_of(block.key), "agent")
    path = store.path_of(block.key, 0)
    written = os.stat(path).st_mtime
    assert written == pytest.approx(clock.now + 3 * DAY)
    utimes = store.ops.calls["utime"]
    clock.now += 60
    assert store.touch(block.key, 0, "agent")  # extends by 1 minute < 43 minutes: skipped
    assert store.ops.calls["utime"] == utimes
    assert store.touch(block.key, 0, "chat")  # chat extends to 7 days
    assert os.stat(path).st_mtime == pytest.approx(clock.now + 7 * DAY)
    clock.now += DAY
    assert store.touch(block.key, 0, "agent")  # an agent touch never shortens it
    assert os.stat(path).st_mtime == pytest.approx(clock.now - DAY + 7 * DAY)
    clock.now += 6 * DAY + 10
    assert store.read(block) is None


# ---------------------------------------------------------------- GC


@pytest.mark.parametrize("seconds_per_write", [0.0, 0.002])
def test_gc_reaches_the_low_watermark_leaves_first(tmp_path, seconds_per_write) -> None:
    """Also when the writes are milliseconds apart, as real ones are: a root's deadline is then
    a little earlier than its leaves', and must not send the root first."""
    clock = Clock()
    file_bytes = fmt.file_size(PAYLOAD)
    store = make_store(tmp_path, clock, max_bytes=10 * file_bytes)
    chains = [chain(5, f"c{i}") for i in range(2)]
    for blocks in chains:  # 10 blocks: over 0.9 × budget
        for block in blocks:
            assert store.write(block, payload_of(block.key), "chat")
            clock.now += seconds_per_write
    report = store.gc_once()
    assert report.ran and report.used_bytes <= 0.8 * 10 * file_bytes
    assert report.evicted == 2 and report.deleted_depths == (4, 4)  # the two leaves
    for blocks in chains:
        assert store.read(blocks[3]) is not None and store.read(blocks[4]) is None
    store.check_integrity()


def test_gc_evicts_earliest_deadline_first(tmp_path) -> None:
    clock = Clock()
    file_bytes = fmt.file_size(PAYLOAD)
    store = make_store(tmp_path, clock, max_bytes=3 * file_bytes)
    old, new = chain(2, "old"), chain(2, "new")
    write_chain(store, old)
    clock.now += 3600
    write_chain(store, new)
    report = store.gc_once()
    assert report.evicted == 2
    assert store.read(old[0]) is None and store.read(new[1]) is not None


def test_blocks_written_while_gc_scans_stay_counted(tmp_path) -> None:
    """A pass's totals replace the store's running ones; a block published after the pass
    listed the directory must still count, or the store reports itself under budget while
    the files are on disk (a background worker then sleeps past the high watermark)."""
    file_bytes = fmt.file_size(PAYLOAD)
    ops = FaultyOps()
    store = make_store(tmp_path, ops=ops, max_bytes=100 * file_bytes)
    early, late = chain(3, "early"), chain(2, "late")
    write_chain(store, early)

    def write_late(path: str) -> None:
        if path == store.directory:  # the top level is listed: the pass sees no later folder
            ops.after_listdir = None
            write_chain(store, late)

    ops.after_listdir = write_late
    report = store.gc_once()
    stats = store.stats()
    assert report.ran and report.num_blocks == stats.num_blocks == 5
    assert report.used_bytes == stats.used_bytes == 5 * file_bytes
    report = store.gc_once()  # the next pass lists them all: the same totals
    assert report.num_blocks == store.stats().num_blocks == 5


def test_one_gc_runner_at_a_time_and_a_crashed_lease_expires(tmp_path) -> None:
    clock = Clock()
    a, b = make_store(tmp_path, clock), make_store(tmp_path, clock)
    lease = os.path.join(a.directory, "gc.lease")
    with open(lease, "w") as f:  # a runner that crashed holding the lease
        f.write(f'{{"owner": "dead", "expires": {clock.now + 60}}}')
    assert not a.gc_once().ran and not b.gc_once().ran
    clock.now += 61
    assert a.gc_once().ran
    assert not os.path.exists(lease)  # released after the pass
    assert b.gc_once().ran  # and runs again: two passes in a row are harmless


def test_low_free_space_skips_writes(tmp_path) -> None:
    store = make_store(tmp_path)
    store.ops.free_bytes = lambda path: 0
    store = make_store(tmp_path, ops=store.ops, min_free_bytes=1 << 20)
    block = chain(1)[0]
    assert store.write(block, payload_of(block.key), "chat") is False
    assert store.stats().write_errors == {"low_space": 1}


def test_a_write_replaces_an_expired_file(tmp_path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock)
    block = chain(1)[0]
    write_chain(store, [block], "agent")
    clock.now += 4 * DAY  # expired, GC has not run
    assert store.read(block) is None
    assert store.write(block, payload_of(block.key), "agent")
    assert store.read(block) == payload_of(block.key)
    assert os.stat(store.path_of(block.key, 0)).st_mtime == pytest.approx(clock.now + 3 * DAY)
    store.check_integrity()


def test_background_gc_worker_runs_when_woken(tmp_path) -> None:
    from engine.kv_cache.store.tiers import BlockTiers, WriteItem

    file_bytes = fmt.file_size(PAYLOAD)
    # Real threads race real files here, so the store's clock is the files' clock: with the
    # test clock years ahead, the worker's first run took an in-flight temp file for a crashed one.
    store = make_store(tmp_path, time.time, max_bytes=10 * file_bytes, gc_interval_s=3600)
    tiers = BlockTiers([store], start_gc=True)
    try:
        blocks = chain(12)
        tiers.write_back("r", [WriteItem(b, payload_of(b.key)) for b in blocks], "chat")
        assert tiers.flush(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the write over the high watermark woke the worker
            now = store.stats()  # a run frees bytes before it counts itself: wait for both
            if now.gc_runs >= 1 and now.used_bytes <= 9 * file_bytes:
                break
            time.sleep(0.05)
        stats = store.stats()
        # GC brings the store under the low watermark (8 files) whenever a write passes the high
        # one (9); writes racing the last run may refill it up to the high watermark, not past.
        assert stats.gc_runs >= 1 and stats.used_bytes <= 9 * file_bytes and stats.evicted >= 3
        assert store.read(blocks[0]) is not None  # leaves go first: the root stays
        # (which leaves went depends on how the runs interleaved with the writes; the
        # leaves-first order itself is tested deterministically above)
    finally:
        tiers.close()
