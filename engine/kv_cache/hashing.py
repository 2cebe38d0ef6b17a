"""Block keys of the prefix cache: a SHA-256 chain over 128-token blocks (`cache.md` §1.4).

    fingerprint = SHA-256(canonical JSON of the namespace fields)         what produced the bytes
    seed        = SHA-256("deepinfer-kv/1" ‖ fingerprint ‖ u32le(len(salt)) ‖ salt)
    key_1       = SHA-256(seed      ‖ u32le(tokens[0:128]))
    key_i       = SHA-256(key_{i−1} ‖ u32le(tokens[128(i−1):128i]))

A key commits to the namespace, the salt and every token before the end of its block, so only an
exact prefix from the first token can match, two salts share no key, and a fingerprint mismatch
(another checkpoint, token map, KV format or replay mode) misses instead of colliding. Pure
functions of their inputs: the same in every process (never Python's `hash()`).

NOTE: image spans (`extras_i` of the design) are not hashed yet; the engine serves text only.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

SCHEMA = "deepinfer-kv/1"
KEY_BYTES = 32


def namespace_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """SHA-256 of the canonical JSON of `fields` (sorted keys, no whitespace); 32 bytes.

    `fields` must be JSON-serialisable (strings, numbers, lists, nested mappings); the schema
    string is added here, so a change of the key scheme changes every fingerprint.
    Raises TypeError for a value JSON cannot encode.
    """
    body = {"schema": SCHEMA, **fields}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).digest()


def combine_salts(*salts: str | None) -> bytes:
    """One salt from several (request `cache_salt`, tenant salt), length-prefixed so that
    ("ab", "c") and ("a", "bc") differ. `None` and "" both mean "no salt" for that part."""
    out = bytearray()
    for salt in salts:
        data = (salt or "").encode()
        out += struct.pack("<I", len(data)) + data
    return bytes(out)


def chain_seed(fingerprint: bytes, salt: bytes = b"") -> bytes:
    """The parent of a chain's first block: SHA-256(schema ‖ fingerprint ‖ len(salt) ‖ salt)."""
    if len(fingerprint) != KEY_BYTES:
        raise ValueError(f"fingerprint must be {KEY_BYTES} bytes, got {len(fingerprint)}")
    digest = hashlib.sha256(SCHEMA.encode())
    digest.update(fingerprint)
    digest.update(struct.pack("<I", len(salt)))
    digest.update(salt)
    return digest.digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of one full block: SHA-256(parent ‖ u32le token ids).

    Raises ValueError for a parent that is not a key, or a token id outside [0, 2³²)."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key, got {len(parent)} bytes")
    try:
        payload = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must lie in [0, 2**32): {exc}") from None
    return hashlib.sha256(parent + payload).digest()


def extend_chain(
    keys: list[bytes], seed: bytes, tokens: Sequence[int], block_tokens: int
) -> list[bytes]:
    """Append to `keys` (the chain so far of `tokens`, from `seed`) the keys of every further
    full block of `tokens`; returns `keys` (mutated in place, so a request hashes each block
    once). A partial last block gets no key."""
    num_full = len(tokens) // block_tokens
    for i in range(len(keys), num_full):
        parent = keys[i - 1] if i else seed
        keys.append(block_key(parent, tokens[i * block_tokens : (i + 1) * block_tokens]))
    return keys


def chain_keys(seed: bytes, tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """Keys of every full block of `tokens` (pure; see `extend_chain`)."""
    return extend_chain([], seed, tokens, block_tokens)
