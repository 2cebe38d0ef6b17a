"""Sealed reasoning tokens: round trip, no forgery, key files."""

from __future__ import annotations

import base64

import pytest

from recipe.sealing import ReasoningSealer, SealError


def test_round_trip_hides_the_text() -> None:
    sealer = ReasoningSealer.random()
    text = "Need the weather first — 天气."
    token = sealer.seal(text)
    assert text not in token and "weather" not in base64.urlsafe_b64decode(token).decode("latin-1")
    assert sealer.unseal(token) == text
    assert sealer.seal(text) != token  # a fresh nonce each time
    assert sealer.unseal(sealer.seal("")) == ""


def test_tokens_cannot_be_forged_or_altered() -> None:
    sealer = ReasoningSealer.random()
    token = sealer.seal("secret plan")
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[20] ^= 1
    altered = base64.urlsafe_b64encode(bytes(raw)).decode()
    for bad in (altered, "rs_X-0", "", "!!!", token[:-8], ReasoningSealer.random().seal("x")):
        with pytest.raises(SealError):
            sealer.unseal(bad)


def test_a_key_file_opens_tokens_across_instances(tmp_path) -> None:
    key_file = tmp_path / "reasoning.key"
    key_file.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    token = ReasoningSealer.from_file(key_file).seal("kept across restarts")
    assert ReasoningSealer.from_file(key_file).unseal(token) == "kept across restarts"
    key_file.write_bytes(b"short")
    with pytest.raises(ValueError, match="32 bytes"):
        ReasoningSealer.from_file(key_file)
