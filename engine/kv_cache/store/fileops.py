"""The directory tiers' only door to the filesystem (`cache.md` §2.4, §6.2).

Every call the block stores make goes through a `FileOps`, so fault-injection tests can
replace one method (truncate a read, flip a byte, raise ENOSPC / EIO / ESTALE, delete a file
between lookup and read, crash between the temp write and the link) without patching `os`.
Methods raise `OSError` exactly as the `os` calls they wrap.
"""

from __future__ import annotations

import os


class FileOps:
    """Thin wrappers over `os`; stateless and thread-safe."""

    def write_new(self, path: str, data: bytes) -> None:
        """Create `path` (it must not exist: O_CREAT | O_EXCL) holding `data`; close it."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def read(self, path: str) -> tuple[bytes, os.stat_result]:
        """The whole file and the `fstat` of the opened file (same inode as the bytes)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            info = os.fstat(fd)
            chunks = []
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks), info
        finally:
            os.close(fd)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)

    def utime(self, path: str, atime: float, mtime: float) -> None:
        os.utime(path, (atime, mtime))

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def free_bytes(self, path: str) -> int:
        """Bytes available to unprivileged writers on the filesystem holding `path`."""
        info = os.statvfs(path)
        return info.f_bavail * info.f_frsize
