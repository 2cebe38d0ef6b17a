"""A `FileOps` with injectable faults, for the directory-tier tests (`cache.md` §6.2)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from engine.kv_cache.store.fileops import FileOps


class SimulatedCrash(BaseException):
    """The process 'dies' here: nothing after this point of the operation runs."""


class FaultyOps(FileOps):
    """Real file operations, except where a test sets a hook.

    read_hook(path, data) -> data: rewrite what a read returns (truncate, flip bytes).
    fail: method name -> errno raised by that method (once per call while set).
    before_read(path): runs after the lookup, before the open (delete the file, race a GC).
    crash_before_link: raise SimulatedCrash between the temp write and the link.
    after_link(path): runs right after a block file is linked into place (race a GC).
    after_listdir(path): runs right after a directory is listed (write while a GC scans).
    calls: method name -> count.
    """

    def __init__(self) -> None:
        self.read_hook: Callable[[str, bytes], bytes] | None = None
        self.before_read: Callable[[str], None] | None = None
        self.fail: dict[str, int] = {}
        self.crash_before_link = False
        self.after_link: Callable[[str], None] | None = None
        self.after_listdir: Callable[[str], None] | None = None
        self.calls: dict[str, int] = {}

    def _enter(self, name: str, path: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        code = self.fail.get(name)
        if code is not None and not path.endswith(".lease") and ".probe" not in path:
            raise OSError(code, os.strerror(code), path)

    def write_new(self, path: str, data: bytes) -> None:
        self._enter("write_new", path)
        super().write_new(path, data)

    def read(self, path: str):
        if self.before_read is not None and path.endswith(".kvb"):
            self.before_read(path)
        self._enter("read", path)
        data, info = super().read(path)
        if self.read_hook is not None and path.endswith(".kvb"):
            data = self.read_hook(path, data)
        return data, info

    def link(self, src: str, dst: str) -> None:
        if self.crash_before_link and dst.endswith(".kvb"):
            raise SimulatedCrash
        self._enter("link", dst)
        super().link(src, dst)
        if self.after_link is not None and dst.endswith(".kvb"):
            self.after_link(dst)

    def listdir(self, path: str) -> list[str]:
        names = super().listdir(path)
        if self.after_listdir is not None:
            self.after_listdir(path)
        return names

    def utime(self, path: str, atime: float, mtime: float) -> None:
        self._enter("utime", path)
        super().utime(path, atime, mtime)


ENOSPC, EIO, ESTALE = errno.ENOSPC, errno.EIO, errno.ESTALE
