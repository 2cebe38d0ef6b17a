"""`DirBlockStore`: one directory tier of KV blocks (a local SSD or a shared mount), one file
per block (`cache.md` §2.4).

    <root>/kv1/<ns16>/NAMESPACE.json                 the fingerprint fields (temp + link)
    <root>/kv1/<ns16>/gc.lease                       who runs GC now, and until when
    <root>/kv1/<ns16>/<k0k1>/<k2k3>/<key64>-<depth>.kvb
    <root>/kv1/<ns16>/<k0k1>/<k2k3>/.tmp-<writer>-<rand>   in-flight writes

`ns16` is the first 16 bytes (hex) of the namespace fingerprint, so another checkpoint, token
map, KV format or replay mode misses instead of colliding.

Publish: write a temp file in the target's directory, `link` it to the final name (the first
writer wins; `EEXIST` is fine, both copies are valid), unlink the temp, set the mtime to the
expiry deadline (an expired file already there is replaced by `rename`). No locks and no
fsync: every read validates the whole file (`format.py`), so a torn or foreign file is a
miss. Reads treat every failure (absent, expired, corrupt by reason, I/O error) as a miss and
count it. The file's mtime holds `last access + TTL(class)`,
only ever extended (`ttl.py`); an expired block is never served, before or after GC.

Thread-safe: readers, writers and GC may run on different threads (and processes).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.kv_cache.store import format as fmt
from engine.kv_cache.store.fileops import FileOps
from engine.kv_cache.store.ttl import TTLPolicy

logger = logging.getLogger(__name__)

LAYOUT = "kv1"
TMP_PREFIX = ".tmp-"
SUFFIX = ".kvb"
_ERRNO_REASONS = {
    errno.ENOSPC: "enospc",
    errno.EDQUOT: "edquot",
    errno.EIO: "eio",
    errno.ESTALE: "estale",
    errno.EACCES: "eacces",
    errno.EROFS: "erofs",
}
_EXISTENCE_TRUST_S = 30.0  # how long a remembered deadline stands in for a `stat`
_MAX_REMEMBERED = 1 << 16


@dataclass(frozen=True)
class DirStoreConfig:
    """One directory tier.

    root: the directory (created if missing). tier: its name in metrics (`local`, `shared`).
    max_bytes: the byte budget of this namespace's files; GC starts above
        `high_watermark × max_bytes` (or when free space < `min_free_bytes`) and deletes until
        used ≤ `low_watermark × max_bytes` and free ≥ `min_free_bytes`. Writes are skipped
        while free space is under the floor.
    gc_interval_s: the background GC's period. lease_s: how long a GC lease lasts unrenewed
        (a crashed GC runner blocks others at most this long).
    tmp_grace_s: temp files older than this are a crashed writer's and GC removes them.
    """

    root: str
    tier: str
    max_bytes: int
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    min_free_bytes: int = 1 << 30
    gc_interval_s: float = 30.0
    lease_s: float = 120.0
    tmp_grace_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError(f"the {self.tier} KV cache directory must not be empty")
        if self.max_bytes < 1:
            raise ValueError(f"the {self.tier} KV cache directory budget must be >= 1 byte")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("watermarks need 0 < low < high <= 1")
        if self.min_free_bytes < 0 or not self.gc_interval_s > 0 or not self.lease_s > 0:
            raise ValueError("min_free_bytes >= 0, gc_interval_s > 0 and lease_s > 0")


@dataclass(frozen=True)
class DirStoreStats:
    """Counters since start (blocks unless named bytes) and the last known occupancy."""

    tier: str
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    blocks_written: int
    touches: int
    expired: int
    evicted: int
    evicted_bytes: int
    gc_runs: int
    used_bytes: int
    num_blocks: int
    read_seconds: float  # total latency of the hits
    corrupt: Mapping[str, int]
    write_errors: Mapping[str, int]


@dataclass(frozen=True)
class GcReport:
    """What one `gc_once` did. ran: False when another runner held the lease."""

    ran: bool
    expired: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    temp_removed: int = 0
    used_bytes: int = 0
    num_blocks: int = 0
    deleted_depths: tuple[int, ...] = ()  # in deletion order (expired first, then evicted)


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    touches: int = 0
    expired: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    gc_runs: int = 0
    read_seconds: float = 0.0
    corrupt: dict[str, int] = field(default_factory=dict)
    write_errors: dict[str, int] = field(default_factory=dict)


class DirBlockStore:
    """Blocks of one namespace in one directory (see the module docstring).

    clock: unix seconds (injected in tests, which move it by days). ops: the filesystem shim.
    on_gc_needed: called (from any thread) when a write finds the tier over its high
    watermark or out of space, so a background GC can run early.
    """

    def __init__(
        self,
        config: DirStoreConfig,
        *,
        fingerprint: bytes,
        namespace_fields: Mapping[str, Any],
        payload_len: int,
        policy: TTLPolicy,
        ops: FileOps | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if len(fingerprint) != 32 or payload_len < 1:
            raise ValueError("fingerprint must be 32 bytes and payload_len >= 1")
        self.config = config
        self.tier = config.tier
        self.policy = policy
        self.payload_len = payload_len
        self.file_bytes = fmt.file_size(payload_len)
        self.namespace = fingerprint[:16]
        self.ops = ops or FileOps()
        self.clock = clock
        self.writer_id = int.from_bytes(
            secrets.token_bytes(4) + os.getpid().to_bytes(4, "little"), "little"
        )
        self.on_gc_needed: Callable[[], None] = lambda: None
        self.directory = os.path.join(config.root, LAYOUT, self.namespace.hex())
        self._lock = threading.Lock()
        self._counters = _Counters()
        self._used_bytes = 0
        self._num_blocks = 0
        # path -> bytes of each block this process published while a GC pass scanned: the
        # pass's totals replace the running ones, and its listing may have missed these.
        self._published_during_gc: dict[str, int] | None = None
        self._deadlines: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self._made_dirs: set[str] = set()
        self._free_checked_at = float("-inf")
        self._low_space = False
        self.ops.makedirs(self.directory)
        self._publish_namespace(namespace_fields)
        self._probe_mtime()

    # ---------------------------------------------------------------- names

    def path_of(self, key: bytes, depth: int) -> str:
        hexkey = key.hex()
        return os.path.join(self.directory, hexkey[:2], hexkey[2:4], f"{hexkey}-{depth}{SUFFIX}")

    # ---------------------------------------------------------------- read path

    def read(self, block: fmt.BlockIdentity) -> bytes | None:
        """The payload of `block`, or None (a miss: absent, expired, corrupt or unreadable;
        counted by reason). A corrupt file is deleted if it is still the same inode.
        Never raises OSError."""
        path = self.path_of(block.key, block.depth)
        started = time.perf_counter()
        try:
            data, info = self.ops.read(path)
        except FileNotFoundError:
            self._count_miss()
            return None
        except OSError as exc:
            self._count_corrupt("io_error")
            logger.debug("%s tier: reading %s failed: %s", self.tier, path, exc)
            return None
        now = self.clock()
        if info.st_mtime <= now:
            with self._lock:
                self._counters.expired += 1
                self._counters.misses += 1
            return None
        try:
            payload = fmt.decode(data, block, self.payload_len)
        except fmt.BlockFormatError as exc:
            self._count_corrupt(exc.reason)
            self._remove_if_unchanged(path, info)
            return None
        with self._lock:
            self._counters.hits += 1
            self._counters.bytes_read += len(data)
            self._counters.read_seconds += time.perf_counter() - started
        self._remember(block.key, info.st_mtime, now)
        return payload

    def contains(self, key: bytes, depth: int) -> bool:
        """Whether an unexpired file exists under the block's name (one `stat`; the bytes are
        not checked). No mutation except the remembered deadline."""
        now = self.clock()
        try:
            info = self.ops.stat(self.path_of(key, depth))
        except OSError:
            return False
        self._remember(key, info.st_mtime, now)
        return info.st_mtime > now

    def remembers(self, key: bytes, now: float) -> bool:
        """Whether this process last saw the block with a deadline after `now` (no I/O)."""
        with self._lock:
            known = self._deadlines.get(key)
        return known is not None and known[0] > now

    def touch(self, key: bytes, depth: int, traffic_class: str) -> bool:
        """Extend the block's deadline to `now + TTL(class)` if that extends it by at least
        the policy's minimum (never shortens it). Returns whether the block exists unexpired.
        Never raises OSError (a failed touch is a no-op)."""
        now = self.clock()
        wanted = now + self.policy.ttl(traffic_class)
        known = self._known_deadline(key, now)
        path = self.path_of(key, depth)
        if known is None:
            try:
                known = self.ops.stat(path).st_mtime
            except OSError:
                self._forget(key)  # gone (another process's GC): the next write-back rewrites it
                return False
            self._remember(key, known, now)
        if known <= now:
            return False
        if wanted - known < self.policy.min_extend(traffic_class):
            return True
        try:
            self.ops.utime(path, now, wanted)
        except OSError:
            self._forget(key)
            return False
        with self._lock:
            self._counters.touches += 1
        self._remember(key, wanted, now)
        return True

    # ---------------------------------------------------------------- write path

    def write(self, block: fmt.BlockIdentity, payload: bytes, traffic_class: str) -> bool:
        """Publish `block` (or touch it when it exists already). Returns False when the write
        was skipped (low space, an I/O error: counted by reason); never raises OSError.

        NOTE: the caller writes a chain parent before child and stops at the first False.
        """
        if len(payload) != self.payload_len:
            raise ValueError(f"payload must be {self.payload_len} bytes, got {len(payload)}")
        if self.touch(block.key, block.depth, traffic_class):
            return True
        if self._is_low_on_space():
            self._count_write_error("low_space")
            return False
        now = self.clock()
        final = self.path_of(block.key, block.depth)
        folder = os.path.dirname(final)
        tmp = os.path.join(folder, f"{TMP_PREFIX}{self.writer_id:016x}-{secrets.token_hex(6)}")
        data = fmt.encode(block, payload, int(now * 1e9), self.writer_id)
        deadline = now + self.policy.ttl(traffic_class)
        try:
            if folder not in self._made_dirs:
                self.ops.makedirs(folder)
                self._made_dirs.add(folder)
            self.ops.write_new(tmp, data)
            # The deadline goes on before the link: a published file must never carry its
            # creation time as mtime, which any GC (another process's too) reads as expired.
            # atime keeps the write time, by which GC ages a crashed writer's temp file.
            self.ops.utime(tmp, now, deadline)
        except OSError as exc:
            self._discard(tmp)
            return self._write_failed(exc)
        try:
            published = self._link(tmp, final)
            if not published and not self.touch(block.key, block.depth, traffic_class):
                self.ops.rename(tmp, final)  # the file there is expired (or gone): replace it
                published = True
        except OSError as exc:
            self._discard(tmp)
            return self._write_failed(exc)
        self._discard(tmp)
        if published:
            self._remember(block.key, deadline, now)
            with self._lock:
                self._counters.bytes_written += len(data)
                self._counters.blocks_written += 1
                self._used_bytes += len(data)
                self._num_blocks += 1
                if self._published_during_gc is not None:
                    self._published_during_gc[final] = len(data)
                over = self._used_bytes > self.config.high_watermark * self.config.max_bytes
            if over:
                self.on_gc_needed()
        return True  # another writer won (its copy was touched)

    # ---------------------------------------------------------------- GC

    def gc_once(self) -> GcReport:
        """One GC pass (`cache.md` §2.4): under the lease, delete expired blocks and stale
        temp files; then, if used > high watermark or free space < floor, delete by earliest
        deadline, deeper first on ties (leaves before parents), until used ≤ low watermark and
        free ≥ floor. Every deletion re-checks the file is unchanged, so two GCs (or a GC and
        a writer) racing only waste work. Returns ran=False when another runner holds the
        lease."""
        from engine.kv_cache.store.gc import GcLease, scan

        lease = GcLease(
            self.ops,
            os.path.join(self.directory, "gc.lease"),
            owner=f"{self.writer_id:016x}",
            lease_s=self.config.lease_s,
            clock=self.clock,
        )
        if not lease.acquire():
            return GcReport(ran=False)
        with self._lock:
            self._published_during_gc = {}
        try:
            now = self.clock()
            entries, temps = scan(self.ops, self.directory)
            removed_tmp = 0
            for path, info in temps:
                written = min(info.st_atime, info.st_mtime)  # atime: set by `write`
                if written < now - self.config.tmp_grace_s and self._unlink_if(path, info):
                    removed_tmp += 1
            used = sum(e.size for e in entries)
            alive, depths = [], []
            num_expired = 0
            for entry in entries:
                if entry.deadline <= now:
                    if self._unlink_if(entry.path, entry.info):
                        num_expired += 1
                        used -= entry.size
                        depths.append(entry.depth)
                        self._forget_path(entry.path)
                else:
                    alive.append(entry)
            free = self._free_bytes()
            cfg = self.config
            num_evicted = evicted_bytes = 0
            if used > cfg.high_watermark * cfg.max_bytes or free < cfg.min_free_bytes:
                alive.sort(key=lambda e: self.policy.eviction_rank(e.deadline, e.depth))
                for entry in alive:
                    if used <= cfg.low_watermark * cfg.max_bytes and free >= cfg.min_free_bytes:
                        break
                    lease.renew_if_due()
                    if self._unlink_if(entry.path, entry.info):
                        num_evicted += 1
                        evicted_bytes += entry.size
                        used -= entry.size
                        free += entry.size
                        depths.append(entry.depth)
                        self._forget_path(entry.path)
            num_blocks = len(alive) - num_evicted
            with self._lock:
                listed = {entry.path for entry in entries}
                for path, size in self._published_during_gc.items():
                    if path not in listed:
                        used += size
                        num_blocks += 1
                self._published_during_gc = None
                c = self._counters
                c.gc_runs += 1
                c.expired += num_expired
                c.evicted += num_evicted
                c.evicted_bytes += evicted_bytes
                self._used_bytes, self._num_blocks = used, num_blocks
            self._free_checked_at = float("-inf")
            return GcReport(
                True, num_expired, num_evicted, evicted_bytes, removed_tmp, used, num_blocks,
                tuple(depths),
            )  # fmt: skip
        finally:
            with self._lock:
                self._published_during_gc = None
            lease.release()

    # ---------------------------------------------------------------- stats, integrity

    def stats(self) -> DirStoreStats:
        with self._lock:
            c = self._counters
            return DirStoreStats(
                tier=self.tier,
                hits=c.hits,
                misses=c.misses,
                bytes_read=c.bytes_read,
                bytes_written=c.bytes_written,
                blocks_written=c.blocks_written,
                touches=c.touches,
                expired=c.expired,
                evicted=c.evicted,
                evicted_bytes=c.evicted_bytes,
                gc_runs=c.gc_runs,
                used_bytes=self._used_bytes,
                num_blocks=self._num_blocks,
                read_seconds=c.read_seconds,
                corrupt=dict(c.corrupt),
                write_errors=dict(c.write_errors),
            )

    def check_integrity(self) -> None:
        """Raise AssertionError unless every `*.kvb` file parses with valid CRCs, belongs to
        this namespace, and carries the key and depth of its name. No mutation."""
        from engine.kv_cache.store.gc import scan

        entries, _ = scan(self.ops, self.directory)
        for entry in entries:
            data, _ = self.ops.read(entry.path)
            try:
                found, _ = fmt.parse(data, self.payload_len)
            except fmt.BlockFormatError as exc:
                raise AssertionError(f"DirBlockStore integrity: {entry.path}: {exc}") from None
            name = os.path.basename(entry.path)
            if name != f"{found.key.hex()}-{found.depth}{SUFFIX}":
                raise AssertionError(f"DirBlockStore integrity: {entry.path} holds another block")
            if found.namespace != self.namespace:
                raise AssertionError(f"DirBlockStore integrity: {entry.path}: foreign namespace")

    # ---------------------------------------------------------------- helpers

    def _publish_namespace(self, fields: Mapping[str, Any]) -> None:
        path = os.path.join(self.directory, "NAMESPACE.json")
        try:
            self.ops.stat(path)
            return
        except FileNotFoundError:
            pass
        tmp = f"{path}{TMP_PREFIX}{secrets.token_hex(6)}"
        body = {"fingerprint": self.namespace.hex(), "fields": fields}
        self.ops.write_new(tmp, json.dumps(body, sort_keys=True, indent=1).encode())
        try:
            self.ops.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            self._discard(tmp)

    def _probe_mtime(self) -> None:
        """Refuse a filesystem that does not keep future mtimes (the deadline lives there)."""
        probe = os.path.join(self.directory, f"{TMP_PREFIX}probe-{secrets.token_hex(6)}")
        future = float(int(self.clock()) + 10 * 86400)
        try:
            self.ops.write_new(probe, b"probe")
            self.ops.utime(probe, future, future)
            kept = abs(self.ops.stat(probe).st_mtime - future) < 2
        finally:
            self._discard(probe)
        if not kept:
            raise RuntimeError(
                f"{self.config.root}: the filesystem does not keep future modification times, "
                "which the KV cache uses as expiry deadlines"
            )

    def _link(self, tmp: str, final: str) -> bool:
        """True: published; False: another writer's copy is there. Raises OSError."""
        try:
            self.ops.link(tmp, final)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
        self.ops.rename(tmp, final)  # no hard links here: last writer wins, both valid
        return True

    def _write_failed(self, exc: OSError) -> bool:
        reason = _ERRNO_REASONS.get(exc.errno or 0, "other")
        self._count_write_error(reason)
        if reason in ("enospc", "edquot"):
            self._low_space = True
            self._free_checked_at = self.clock()
            self.on_gc_needed()
        return False

    def _is_low_on_space(self) -> bool:
        now = self.clock()
        if now - self._free_checked_at >= 1.0:
            self._free_checked_at = now
            self._low_space = self._free_bytes() < self.config.min_free_bytes
            if self._low_space:
                self.on_gc_needed()
        return self._low_space

    def _free_bytes(self) -> int:
        try:
            return self.ops.free_bytes(self.directory)
        except OSError:
            return 0

    def _unlink_if(self, path: str, seen: os.stat_result) -> bool:
        """Unlink `path` if it is still the inode (and mtime) seen earlier."""
        try:
            now = self.ops.stat(path)
            if now.st_ino != seen.st_ino or now.st_mtime_ns != seen.st_mtime_ns:
                return False
            self.ops.unlink(path)
            return True
        except OSError:
            return False

    def _remove_if_unchanged(self, path: str, seen: os.stat_result) -> None:
        self._unlink_if(path, seen)
        self._forget_path(path)

    def _discard(self, path: str) -> None:
        with contextlib.suppress(OSError):
            self.ops.unlink(path)

    def _remember(self, key: bytes, deadline: float, now: float) -> None:
        with self._lock:
            self._deadlines[key] = (deadline, now)
            self._deadlines.move_to_end(key)
            while len(self._deadlines) > _MAX_REMEMBERED:
                self._deadlines.popitem(last=False)

    def _known_deadline(self, key: bytes, now: float) -> float | None:
        with self._lock:
            known = self._deadlines.get(key)
        if known is None or now - known[1] > _EXISTENCE_TRUST_S:
            return None
        return known[0]

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._deadlines.pop(key, None)

    def _forget_path(self, path: str) -> None:
        name = os.path.basename(path)
        with contextlib.suppress(ValueError):
            self._forget(bytes.fromhex(name.split("-", 1)[0]))

    def _count_miss(self) -> None:
        with self._lock:
            self._counters.misses += 1

    def _count_corrupt(self, reason: str) -> None:
        with self._lock:
            self._counters.misses += 1
            self._counters.corrupt[reason] = self._counters.corrupt.get(reason, 0) + 1

    def _count_write_error(self, reason: str) -> None:
        with self._lock:
            errors = self._counters.write_errors
            errors[reason] = errors.get(reason, 0) + 1
