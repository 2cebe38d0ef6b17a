"""Engram n-gram hashing (`model.md` §3.9): token map, primes, multipliers, hash ids.

Every number here is part of the checkpoint's contract: the released tables were trained with
exactly these buckets, so a single differing compressed id, prime or multiplier silently turns
the Engram lookups into noise. Integers stay Python ints or int64 tensors, never floats.

Per token position p and Engram layer, the hash ids are built from the look-back matrix::

    column s      0        1         2         3          (max_ngram_size = 4)
    token       t[p]    t[p-1]    t[p-2]    t[p-3]         -1 = before the sequence start
    c_s         map(t)  ...                                BLOCKED -> map(pad_id)
    prod_s      c_s * mult[s]
    roll_n      prod_0 ^ prod_1 ^ ... ^ prod_n             n = 1..3 -> (n+1)-grams
    id          roll_n % P[n-1][k] + off[(n-1)*heads + k]  k = 0..heads-1

so a layer gathers (max_ngram_size - 1) * heads rows per token, column order (n-gram, head).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

from kernels import engram_hash as engram_hash_kernel
from kernels import runs_kernels

BLOCKED_TOKEN = -1
"""Look-back entry meaning "before the start of the sequence" (`lookback_matrix`)."""

_MULTIPLIER_SEED = 10007
_REPLACEMENT_CHAR = "\ufffd"
# A private-use character stands in for a token that normalises to a lone space, so `Strip`
# cannot empty it; it is turned back into a space as the last step.
_LONE_SPACE_SENTINEL = "\ue000"
_INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------------------------
# Token map
# --------------------------------------------------------------------------------------------


def _token_map_normalizer() -> normalizers.Normalizer:
    """NFKC → NFD → strip accents → lowercase → collapse whitespace → protect lone space → strip."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
        ]
    )


def build_compressed_token_map(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """Map every token id onto the compressed id space the Engram hash works in.

    Each id in ``0..vocab_size-1`` is decoded alone (special tokens kept). A text containing
    U+FFFD (a partial UTF-8 byte token) is keyed by its raw token string; any other text by its
    normalised form (see `_token_map_normalizer`), or by the text itself when that form is empty.
    Compressed ids are handed out in order of first appearance of each key.

    Returns:
        int64 array ``[vocab_size]``; its ``max() + 1`` is the compressed vocabulary size
        (99,092 for the V4 / V4.1 tokenizer).
    Raises:
        ValueError: ``vocab_size`` is not in ``1..tokenizer size`` (added tokens included).
    """
    tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 1 <= vocab_size <= tokenizer_size:
        raise ValueError(f"vocab_size {vocab_size} outside 1..{tokenizer_size} (tokenizer size)")
    texts = tokenizer.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    normalize = _token_map_normalizer().normalize_str
    key_to_id: dict[str, int] = {}
    token_map = np.empty(vocab_size, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalize(text) or text
        token_map[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return token_map


def token_map_digest(token_map: np.ndarray) -> str:
    """Hex sha256 of the map as little-endian int64 bytes (a cache key for a built map)."""
    data = np.ascontiguousarray(token_map, dtype="<i8")
    return hashlib.sha256(data.tobytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# Primes, offsets, multipliers
# --------------------------------------------------------------------------------------------

# Deterministic Miller-Rabin bases: exact for every n < 3.3e24.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    engram_layer_ids: Sequence[int], engram_vocab_size: int, max_ngram_size: int, n_heads: int
) -> list[list[list[int]]]:
    """Bucket counts of every hash head, indexed ``[layer][ngram - 2][head]``.

    For each Engram layer in order and each n-gram size (2..max_ngram_size), ``n_heads``
    primes are taken by scanning upward from ``engram_vocab_size - 1`` (so the first candidates
    are the primes > vocab - 1), skipping every prime already handed out to any layer.

    Example (released config): layer 1 starts 16000057, 16000079, 16000081; layer 14 spans
    16000477..16000889.
    """
    if engram_vocab_size < 1 or max_ngram_size < 2 or n_heads < 1:
        raise ValueError("need engram_vocab_size >= 1, max_ngram_size >= 2 and n_heads >= 1")
    if len(set(engram_layer_ids)) != len(engram_layer_ids):
        raise ValueError(f"duplicate Engram layer ids: {list(engram_layer_ids)}")
    used: set[int] = set()
    primes: list[list[list[int]]] = []
    for _ in engram_layer_ids:
        per_ngram: list[list[int]] = []
        for _ in range(max_ngram_size - 1):
            heads: list[int] = []
            candidate = engram_vocab_size - 1
            while len(heads) < n_heads:
                candidate += 1
                if candidate not in used and _is_prime(candidate):
                    used.add(candidate)
                    heads.append(candidate)
            per_ngram.append(heads)
        primes.append(per_ngram)
    return primes


def engram_offsets(primes_of_layer: Sequence[Sequence[int]]) -> list[int]:
    """Exclusive prefix sums of one layer's primes in (n-gram, head) order; first is 0."""
    offsets: list[int] = []
    total = 0
    for heads in primes_of_layer:
        for prime in heads:
            offsets.append(total)
            total += prime
    return offsets


def engram_table_rows(primes_of_layer: Sequence[Sequence[int]]) -> int:
    """Rows of one layer's Engram table: the sum of its primes (384006168 for layer 1)."""
    return sum(sum(heads) for heads in primes_of_layer)


def hash_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> list[int]:
    """The odd per-look-back multipliers of one layer, as Python ints.

    ``default_rng(10007 * layer_id).integers(0, bound, size=max_ngram_size) * 2 + 1`` with
    ``bound = (2**63 - 1) // compressed_vocab_size // 2``, so that ``c * mult`` fits in int64 for
    every compressed id ``c < compressed_vocab_size``.
    """
    if compressed_vocab_size < 1 or max_ngram_size < 1:
        raise ValueError("need compressed_vocab_size >= 1 and max_ngram_size >= 1")
    bound = _INT64_MAX // compressed_vocab_size // 2
    if bound < 1:
        raise ValueError(f"compressed_vocab_size {compressed_vocab_size} leaves no multiplier")
    rng = np.random.default_rng(_MULTIPLIER_SEED * layer_id)
    draws = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return [int(v) * 2 + 1 for v in draws.tolist()]


@dataclass(frozen=True)
class EngramHashTables:
    """The integer constants of one Engram layer's hash (all int64, same device).

    Attributes:
        layer_id: the decoder layer carrying this Engram.
        compressed_vocab_size: size of the token-map image; every map value must be below it.
        multipliers: ``[max_ngram_size]`` odd multipliers, one per look-back column.
        primes: ``[max_ngram_size - 1, n_heads]`` bucket counts.
        offsets: ``[(max_ngram_size - 1) * n_heads]`` first table row of each hash column.
    """

    layer_id: int
    compressed_vocab_size: int
    multipliers: torch.Tensor
    primes: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("multipliers", "primes", "offsets"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.int64:
                raise ValueError(f"{name} must be int64, got {tensor.dtype}")
        max_ngram_size = self.multipliers.shape[0]
        if self.multipliers.ndim != 1 or self.primes.ndim != 2:
            raise ValueError("multipliers must be 1-D and primes 2-D")
        if self.primes.shape[0] != max_ngram_size - 1:
            raise ValueError("primes must have one row per n-gram size (max_ngram_size - 1)")
        if self.offsets.shape != (self.primes.numel(),):
            raise ValueError("offsets must have one entry per (n-gram, head) column")

    @property
    def max_ngram_size(self) -> int:
        return self.multipliers.shape[0]

    @property
    def n_heads(self) -> int:
        return self.primes.shape[1]

    @property
    def num_columns(self) -> int:
        """Hash ids per token: (max_ngram_size - 1) * n_heads."""
        return self.offsets.shape[0]

    @property
    def num_rows(self) -> int:
        """Rows of the layer's table (sum of the primes)."""
        return int(self.primes.sum())

    def to(self, device: torch.device | str) -> EngramHashTables:
        """A copy with every tensor on ``device`` (self is left unchanged)."""
        return replace(
            self,
            multipliers=self.multipliers.to(device),
            primes=self.primes.to(device),
            offsets=self.offsets.to(device),
        )


def build_engram_hash_tables(
    engram_layer_ids: Sequence[int],
    engram_vocab_size: int,
    max_ngram_size: int,
    n_heads: int,
    compressed_vocab_size: int,
) -> tuple[EngramHashTables, ...]:
    """The hash constants of every Engram layer, in ``engram_layer_ids`` order (CPU tensors)."""
    all_primes = engram_primes(engram_layer_ids, engram_vocab_size, max_ngram_size, n_heads)
    return tuple(
        EngramHashTables(
            layer_id=layer_id,
            compressed_vocab_size=compressed_vocab_size,
            multipliers=torch.tensor(
                hash_multipliers(layer_id, compressed_vocab_size, max_ngram_size),
                dtype=torch.int64,
            ),
            primes=torch.tensor(primes, dtype=torch.int64),
            offsets=torch.tensor(engram_offsets(primes), dtype=torch.int64),
        )
        for layer_id, primes in zip(engram_layer_ids, all_primes, strict=True)
    )


# --------------------------------------------------------------------------------------------
# Hash ids
# --------------------------------------------------------------------------------------------


def lookback_matrix(tokens: torch.Tensor, max_ngram_size: int) -> torch.Tensor:
    """Look-back matrix of one whole sequence: ``out[p, s] = tokens[p - s]``, or -1 if p < s.

    Args:
        tokens: LongTensor ``[L]`` of raw token ids.
    Returns:
        LongTensor ``[L, max_ngram_size]`` on the device of ``tokens``.
    """
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    lead = torch.full((max_ngram_size - 1,), BLOCKED_TOKEN, dtype=torch.int64, device=tokens.device)
    padded = torch.cat([lead, tokens.long()])
    # window p = padded[p : p + max_ngram_size] = tokens[p - max_ngram_size + 1 .. p]
    return padded.unfold(0, max_ngram_size, 1).flip(1)


def engram_hash_ids(
    token_ids: torch.Tensor,
    token_map: torch.Tensor,
    tables: EngramHashTables,
    pad_id: int = 2,
    image_token_id: int | None = None,
) -> torch.Tensor:
    """Table row ids of one Engram layer for ``T`` positions (on the kernel path
    `kernels.engram_hash`: one launch, the ids of `engram_hash_ids_reference`).

    Args:
        token_ids: LongTensor ``[T, max_ngram_size]``; column s is the raw token at position
            p - s, or ``BLOCKED_TOKEN`` (-1) before the start of the sequence.
        token_map: LongTensor ``[vocab]``, raw id -> compressed id (`build_compressed_token_map`).
        tables: this layer's constants, on the same device as the inputs.
        pad_id: raw id whose compressed id stands in for every blocked look-back.
        image_token_id: raw image-token id, or None when there is none.
    Returns:
        LongTensor ``[T, (max_ngram_size - 1) * n_heads]``, column (n - 1) * n_heads + k for the
        (n + 1)-gram and head k; values in ``0..tables.num_rows - 1``.

    Scanning s = 0, 1, ...: the first -1 or image token met blocks itself and every older
    look-back, so an n-gram never reaches past a sequence start or across an image.

    NOTE: every ``token_map`` value must be below ``tables.compressed_vocab_size``; the
    multiplier bound then keeps each product below 2**63, so the XORs stay non-negative and
    ``%`` is the plain mathematical remainder. The map is not re-checked here (no device sync).
    """
    if token_ids.ndim != 2 or token_ids.shape[1] != tables.max_ngram_size:
        raise ValueError(
            f"token_ids must be [T, {tables.max_ngram_size}], got {tuple(token_ids.shape)}"
        )
    if token_ids.dtype != torch.int64 or token_map.dtype != torch.int64:
        raise ValueError("token_ids and token_map must be int64")
    if runs_kernels(token_ids):
        return engram_hash_kernel.engram_hash(
            token_ids,
            token_map,
            tables.multipliers,
            tables.primes,
            tables.offsets,
            pad_id,
            image_token_id,
        )
    return engram_hash_ids_reference(token_ids, token_map, tables, pad_id, image_token_id)


def engram_hash_ids_reference(
    token_ids: torch.Tensor,
    token_map: torch.Tensor,
    tables: EngramHashTables,
    pad_id: int = 2,
    image_token_id: int | None = None,
) -> torch.Tensor:
    """`engram_hash_ids`' torch form (the kernel path's `kernels.engram_hash` gives the same
    ids in one launch); the inputs as `engram_hash_ids` checks them."""
    num_positions, max_ngram_size = token_ids.shape
    is_stop = token_ids < 0
    if image_token_id is not None:
        is_stop |= token_ids == image_token_id
    is_blocked = is_stop.cumsum(dim=1) > 0
    compressed = token_map[token_ids.clamp(min=0)]
    compressed = torch.where(is_blocked, token_map[pad_id], compressed)
    products = compressed * tables.multipliers  # [T, S]
    rolls = []
    roll = products[:, 0]
    for n in range(1, max_ngram_size):
        roll = roll ^ products[:, n]
        rolls.append(roll)
    rolled = torch.stack(rolls, dim=1)  # [T, S - 1]
    ids = rolled.unsqueeze(-1) % tables.primes  # [T, S - 1, heads]
    return ids.reshape(num_positions, -1) + tables.offsets
