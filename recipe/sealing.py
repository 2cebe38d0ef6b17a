"""Sealed reasoning: Responses `encrypted_content` that only this server can read (issue 14).

Clients that do not store responses (`store: false`, Codex) keep the model's reasoning between
turns as an opaque `encrypted_content` string and send it back in `input`. `ReasoningSealer`
seals the reasoning text into such a string and opens it again; a string that was not sealed
with the same key (forged, altered, from another server or an earlier process with a random
key) does not open.

Construction (encrypt-then-MAC over Python's stdlib):

    token = base64url(VERSION || nonce[16] || ciphertext || tag[32])
    ciphertext = utf8(text) XOR SHAKE-256(enc_key || nonce)       (keystream, len(text) bytes)
    tag = HMAC-SHA256(mac_key, VERSION || nonce || ciphertext)
    enc_key, mac_key = HMAC-SHA256(key, "enc" | "mac")             (key: >= 32 secret bytes)

NOTE: the tag is checked (in constant time) before anything is decrypted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from pathlib import Path

VERSION = b"\x01"
NONCE_LEN = 16
TAG_LEN = 32
MIN_KEY_LEN = 32


class SealError(ValueError):
    """A token that does not open: malformed, or not sealed with this key."""


class ReasoningSealer:
    """Seals reasoning text with one secret key. Immutable and thread-safe."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_LEN:
            raise ValueError(f"a reasoning key needs at least {MIN_KEY_LEN} bytes")
        self._enc_key = hmac.digest(key, b"enc", "sha256")
        self._mac_key = hmac.digest(key, b"mac", "sha256")

    @classmethod
    def random(cls) -> ReasoningSealer:
        """A sealer with a fresh key: its tokens open only in this process."""
        return cls(secrets.token_bytes(MIN_KEY_LEN))

    @classmethod
    def from_file(cls, path: Path | str) -> ReasoningSealer:
        """A sealer keyed by the bytes of `path` (surrounding whitespace stripped), so tokens
        open across restarts and on every replica given the same file.

        Raises:
            OSError: the file cannot be read. ValueError: it holds fewer than 32 bytes.
        """
        return cls(Path(path).read_bytes().strip())

    def seal(self, text: str) -> str:
        """An opaque token holding `text`."""
        nonce = secrets.token_bytes(NONCE_LEN)
        plain = text.encode("utf-8")
        ciphertext = _xor(plain, self._keystream(nonce, len(plain)))
        tag = hmac.digest(self._mac_key, VERSION + nonce + ciphertext, "sha256")
        return base64.urlsafe_b64encode(VERSION + nonce + ciphertext + tag).decode("ascii")

    def unseal(self, token: str) -> str:
        """The text sealed in `token`.

        Raises:
            SealError: `token` is not a token of this sealer's key (or not a token at all).
        """
        try:
            raw = base64.urlsafe_b64decode(token.encode("ascii"))
        except (UnicodeEncodeError, binascii.Error) as exc:
            raise SealError("not a sealed reasoning token") from exc
        if len(raw) < 1 + NONCE_LEN + TAG_LEN or raw[:1] != VERSION:
            raise SealError("not a sealed reasoning token")
        body, tag = raw[:-TAG_LEN], raw[-TAG_LEN:]
        if not hmac.compare_digest(tag, hmac.digest(self._mac_key, body, "sha256")):
            raise SealError("the token was not sealed by this server's reasoning key")
        nonce, ciphertext = body[1 : 1 + NONCE_LEN], body[1 + NONCE_LEN :]
        try:
            return _xor(ciphertext, self._keystream(nonce, len(ciphertext))).decode("utf-8")
        except UnicodeDecodeError as exc:  # cannot happen for a token this key sealed
            raise SealError("not a sealed reasoning token") from exc

    def _keystream(self, nonce: bytes, length: int) -> bytes:
        return hashlib.shake_256(self._enc_key + nonce).digest(length)


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")
