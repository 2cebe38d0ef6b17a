"""Block file format, version 1 (`cache.md` §2.4): a 4 KiB self-describing header, then the
payload zero-padded to whole 4 KiB pages.

    offset  size  field
    0       8     magic b"DIKVBLK\\0"
    8       2     format version (1)
    10      2     header length (4096)
    12      4     flags (0)
    16      16    namespace digest (first 16 bytes of the fingerprint)
    32      32    block key
    64      32    parent key (the chain seed for depth 0)
    96      4     depth (block index in the chain)
    100     4     number of tokens
    104     4     payload length
    108     4     payload CRC-32
    112     8     created at (unix ns, writer's clock)
    120     8     writer id
    128     4·n   token ids, u32 little-endian (n ≤ 128 for the released block size)
    ...           zero padding
    4092    4     header CRC-32 over bytes 0 .. 4091

Everything is little-endian. `decode` checks every field against what the reader expects and
raises `BlockFormatError` naming the first mismatch (the metric's `reason` label).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"DIKVBLK\0"
VERSION = 1
HEADER_BYTES = 4096
PAGE_BYTES = 4096
MAX_TOKENS = (HEADER_BYTES - 4 - 128) // 4
_FIXED = struct.Struct("<8sHHI16s32s32sIIIIQQ")  # bytes 0 .. 127

# The `reason` of a read that found a file but could not use it.
CORRUPT_REASONS = (
    "size",
    "magic",
    "version",
    "header_crc",
    "namespace",
    "key",
    "parent",
    "depth",
    "tokens",
    "payload_crc",
)


class BlockFormatError(ValueError):
    """A block file that is not the expected block; `reason` is one of CORRUPT_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockIdentity:
    """What a block is: its namespace, chain position and tokens (all checked on read)."""

    namespace: bytes  # 16 bytes
    key: bytes  # 32 bytes
    parent: bytes  # 32 bytes
    depth: int
    token_ids: tuple[int, ...]


def padded_len(payload_len: int) -> int:
    """`payload_len` rounded up to whole 4 KiB pages: what a payload takes in a block file and
    in a host-tier slot (`cache.md` §1.3: the same payload bytes in every tier)."""
    return -(-payload_len // PAGE_BYTES) * PAGE_BYTES


def file_size(payload_len: int) -> int:
    """Bytes of a block file whose payload has `payload_len` bytes."""
    return HEADER_BYTES + padded_len(payload_len)


def encode(
    block: BlockIdentity, payload: bytes | memoryview, created_ns: int, writer_id: int
) -> bytes:
    """The file bytes of `block` with `payload` (the canonical block payload, e.g. a host-tier
    slot's bytes as they are). Raises ValueError for malformed fields."""
    if len(block.namespace) != 16 or len(block.key) != 32 or len(block.parent) != 32:
        raise ValueError("namespace must be 16 bytes, key and parent 32")
    if len(block.token_ids) > MAX_TOKENS:
        raise ValueError(f"a block holds at most {MAX_TOKENS} token ids")
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        HEADER_BYTES,
        0,
        block.namespace,
        block.key,
        block.parent,
        block.depth,
        len(block.token_ids),
        len(payload),
        zlib.crc32(payload),
        created_ns,
        writer_id & ((1 << 64) - 1),
    )
    tokens = struct.pack(f"<{len(block.token_ids)}I", *block.token_ids)
    header = bytearray(HEADER_BYTES)
    header[: _FIXED.size] = fixed
    header[_FIXED.size : _FIXED.size + len(tokens)] = tokens
    header[-4:] = struct.pack("<I", zlib.crc32(header[:-4]))
    padding = bytes(file_size(len(payload)) - HEADER_BYTES - len(payload))
    return bytes(header) + payload + padding


def parse(data: bytes, payload_len: int) -> tuple[BlockIdentity, bytes]:
    """The identity and payload of a block file, after checking its size, magic, version,
    header CRC and payload CRC (not what it should be: see `decode`).

    Raises BlockFormatError(reason) for the first check that fails.
    """
    if len(data) != file_size(payload_len):
        raise BlockFormatError("size", f"{len(data)} bytes, expected {file_size(payload_len)}")
    fields = _FIXED.unpack_from(data)
    magic, version, header_len, _, namespace, key, parent, depth, num_tokens = fields[:9]
    stored_len, payload_crc = fields[9], fields[10]
    if magic != MAGIC:
        raise BlockFormatError("magic")
    if version != VERSION or header_len != HEADER_BYTES:
        raise BlockFormatError("version", f"version {version}, header {header_len}")
    if struct.unpack_from("<I", data, HEADER_BYTES - 4)[0] != zlib.crc32(data[: HEADER_BYTES - 4]):
        raise BlockFormatError("header_crc")
    if stored_len != payload_len or num_tokens > MAX_TOKENS:
        raise BlockFormatError("size", f"payload {stored_len} bytes, expected {payload_len}")
    payload = data[HEADER_BYTES : HEADER_BYTES + payload_len]
    if zlib.crc32(payload) != payload_crc:
        raise BlockFormatError("payload_crc")
    tokens = struct.unpack_from(f"<{num_tokens}I", data, _FIXED.size)
    return BlockIdentity(namespace, key, parent, depth, tokens), payload


def decode(data: bytes, expected: BlockIdentity, payload_len: int) -> bytes:
    """The payload of a block file that is exactly the `expected` block: `parse`'s checks,
    then namespace, key, parent, depth and token ids.

    Raises BlockFormatError(reason) for the first check that fails.
    """
    found, payload = parse(data, payload_len)
    for reason in ("namespace", "key", "parent", "depth"):
        if getattr(found, reason) != getattr(expected, reason):
            raise BlockFormatError(reason)
    if found.token_ids != tuple(expected.token_ids):
        raise BlockFormatError("tokens")
    return payload
