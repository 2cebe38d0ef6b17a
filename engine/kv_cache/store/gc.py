"""GC helpers of the directory tiers: the directory scan, the GC lease, the background worker
(`cache.md` §2.4, "GC: watermarks, LRU, leases").

One GC runs per directory at a time: it holds `gc.lease` (owner + expiry, created with
O_CREAT | O_EXCL, renewed and stolen by temp + rename once expired). Two runners at once (a
stolen lease, a clock skew) are harmless: every action is an unlink of a file that is still
the inode the scan saw.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache.store.fileops import FileOps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileEntry:
    """One published block file as a scan saw it; its mtime is its deadline."""

    path: str
    depth: int
    info: os.stat_result

    @property
    def deadline(self) -> float:
        return self.info.st_mtime

    @property
    def size(self) -> int:
        return self.info.st_size


def scan(ops: FileOps, directory: str) -> tuple[list[FileEntry], list[tuple[str, os.stat_result]]]:
    """Every block file and every temp file under a namespace directory (two fan-out levels).
    Files that vanish during the scan are skipped; unreadable directories count as empty."""
    from engine.kv_cache.store.dirstore import SUFFIX, TMP_PREFIX

    blocks: list[FileEntry] = []
    temps: list[tuple[str, os.stat_result]] = []
    for first in _names(ops, directory):
        if len(first) != 2:
            continue
        for second in _names(ops, os.path.join(directory, first)):
            folder = os.path.join(directory, first, second)
            for name in _names(ops, folder):
                path = os.path.join(folder, name)
                is_block = name.endswith(SUFFIX)
                if not is_block and not name.startswith(TMP_PREFIX):
                    continue
                try:
                    info = ops.stat(path)
                except OSError:
                    continue
                if not is_block:
                    temps.append((path, info))
                    continue
                try:
                    depth = int(name[: -len(SUFFIX)].rsplit("-", 1)[1])
                except (IndexError, ValueError):
                    continue
                blocks.append(FileEntry(path, depth, info))
    return blocks, temps


def _names(ops: FileOps, folder: str) -> list[str]:
    try:
        return sorted(ops.listdir(folder))
    except OSError:
        return []


class GcLease:
    """The right to run GC in one directory until `expires` (unix seconds, injected clock)."""

    def __init__(
        self, ops: FileOps, path: str, *, owner: str, lease_s: float, clock: Callable[[], float]
    ) -> None:
        self.ops, self.path, self.owner = ops, path, owner
        self.lease_s, self.clock = lease_s, clock
        self._renewed_at = float("-inf")

    def acquire(self) -> bool:
        """Take the lease if it is free, expired or ours. Returns whether we hold it."""
        try:
            self.ops.write_new(self.path, self._body())
            self._renewed_at = self.clock()
            return True
        except FileExistsError:
            pass
        except OSError:
            return False
        holder = self._read()
        if holder is not None and holder[0] != self.owner and holder[1] > self.clock():
            return False
        if not self._replace():
            return False
        holder = self._read()  # two stealers: the last rename wins, the other backs off
        return holder is not None and holder[0] == self.owner

    def renew_if_due(self) -> None:
        """Extend the lease when a third of it has passed (long passes keep it)."""
        if self.clock() - self._renewed_at > self.lease_s / 3:
            self._replace()

    def release(self) -> None:
        holder = self._read()
        if holder is not None and holder[0] == self.owner:
            with contextlib.suppress(OSError):
                self.ops.unlink(self.path)

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "expires": self.clock() + self.lease_s}).encode()

    def _replace(self) -> bool:
        tmp = f"{self.path}.tmp-{secrets.token_hex(6)}"
        try:
            self.ops.write_new(tmp, self._body())
            self.ops.rename(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                self.ops.unlink(tmp)
            return False
        self._renewed_at = self.clock()
        return True

    def _read(self) -> tuple[str, float] | None:
        try:
            data, _ = self.ops.read(self.path)
            body = json.loads(data)
            return str(body["owner"]), float(body["expires"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent or torn: treated as free


class GcWorker:
    """A daemon thread that runs `gc_once()` every `interval_s` seconds, or at once when
    `wake()` is called (a write found the tier full). Exceptions are logged, never raised."""

    def __init__(self, gc_once: Callable[[], object], interval_s: float, name: str) -> None:
        self._gc_once = gc_once
        self._interval_s = interval_s
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wakeup.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                self._gc_once()
            except Exception:
                logger.exception("KV cache GC pass failed")
            self._wakeup.wait(self._interval_s)
            self._wakeup.clear()
