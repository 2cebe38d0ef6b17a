import hashlib
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from engine.models.deepseek_v41.engram_hash import (
    BLOCKED_TOKEN,
    EngramHashTables,
    build_compressed_token_map,
    build_engram_hash_tables,
    engram_hash_ids,
    engram_offsets,
    engram_primes,
    engram_table_rows,
    hash_multipliers,
    lookback_matrix,
    token_map_digest,
)
from engine.models.deepseek_v41.tokenizer_files import v4_tokenizer_json_path, write_v41_tokenizer

REAL = {"engram_layer_ids": [1, 14], "engram_vocab_size": 16_000_000, "max_ngram_size": 4}
REAL_COMPRESSED = 99092
REAL_MAP_DIGEST = "26b9be2936d236a124ba318a998c417bc7032e3e92a3107fe98deee49f1dc496"
MULTIPLIERS_L1 = [76632096046245, 4839876093313, 35959672319349, 73987337458391]
MULTIPLIERS_L14 = [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def _is_prime_slow(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


# ---------------------------------------------------------------------------- primes


def test_real_primes():
    primes = engram_primes(**REAL, n_heads=8)
    assert len(primes) == 2 and all(len(layer) == 3 for layer in primes)
    assert primes[0][0][:3] == [16000057, 16000079, 16000081]
    assert primes[1][0][0] == 16000477 and primes[1][-1][-1] == 16000889
    assert [engram_table_rows(layer) for layer in primes] == [384006168, 384016682]
    # Scanning upward without reuse hands out the 48 consecutive primes above vocab - 1.
    flat = [p for layer in primes for heads in layer for p in heads]
    expected = [n for n in range(16_000_000, 16_000_890) if _is_prime_slow(n)]
    assert flat == expected


def test_tiny_primes():
    primes = engram_primes([0, 1], 1000, 4, 2)
    assert primes == [
        [[1009, 1013], [1019, 1021], [1031, 1033]],
        [[1039, 1049], [1051, 1061], [1063, 1069]],
    ]
    assert [engram_table_rows(layer) for layer in primes] == [6126, 6332]


def test_primes_reject_bad_arguments():
    with pytest.raises(ValueError):
        engram_primes([1, 1], 1000, 4, 2)
    with pytest.raises(ValueError):
        engram_primes([1], 1000, 1, 2)


def test_offsets_are_exclusive_prefix_sums():
    layer = engram_primes(**REAL, n_heads=8)[0]
    offsets = engram_offsets(layer)
    flat = [p for heads in layer for p in heads]
    assert offsets[0] == 0 and len(offsets) == 24
    assert offsets[1] == 16000057
    assert all(offsets[i + 1] - offsets[i] == flat[i] for i in range(23))
    assert offsets[-1] + flat[-1] == engram_table_rows(layer)


# ---------------------------------------------------------------------------- multipliers


def test_multipliers_test_vectors():
    assert hash_multipliers(1, REAL_COMPRESSED, 4) == MULTIPLIERS_L1
    assert hash_multipliers(14, REAL_COMPRESSED, 4) == MULTIPLIERS_L14
    bound = (2**63 - 1) // REAL_COMPRESSED // 2
    for layer_id in (0, 1, 14):
        values = hash_multipliers(layer_id, REAL_COMPRESSED, 4)
        assert all(type(v) is int and v % 2 == 1 and v < 2 * bound for v in values)
        assert max(values) * (REAL_COMPRESSED - 1) < 2**63


def test_build_tables():
    tables = build_engram_hash_tables([1, 14], 16_000_000, 4, 8, REAL_COMPRESSED)
    assert [t.layer_id for t in tables] == [1, 14]
    first = tables[0]
    assert first.multipliers.tolist() == MULTIPLIERS_L1
    assert tables[1].multipliers.tolist() == MULTIPLIERS_L14
    assert first.primes.shape == (3, 8) and first.offsets.shape == (24,)
    assert all(t.dtype == torch.int64 for t in (first.multipliers, first.primes, first.offsets))
    assert (first.max_ngram_size, first.n_heads, first.num_columns) == (4, 8, 24)
    assert [t.num_rows for t in tables] == [384006168, 384016682]
    assert first.offsets.tolist() == engram_offsets(first.primes.tolist())
    with pytest.raises(ValueError):
        EngramHashTables(1, 10, first.multipliers.float(), first.primes, first.offsets)


# ---------------------------------------------------------------------------- hash ids


def test_lookback_matrix():
    tokens = torch.tensor([10, 11, 12, 13, 14])
    expected = [
        [10, -1, -1, -1],
        [11, 10, -1, -1],
        [12, 11, 10, -1],
        [13, 12, 11, 10],
        [14, 13, 12, 11],
    ]
    assert lookback_matrix(tokens, 4).tolist() == expected
    assert lookback_matrix(torch.tensor([7]), 4).tolist() == [[7, -1, -1, -1]]


def _reference_hash(row, token_map, tables, pad_id, image_token_id):
    """Plain-Python scalar transcription of model.md §3.9 for one position."""
    mult = tables.multipliers.tolist()
    primes = tables.primes.tolist()
    offsets = tables.offsets.tolist()
    blocked = False
    products = []
    for s, tok in enumerate(row):
        blocked = blocked or tok in (BLOCKED_TOKEN, image_token_id)
        c = token_map[pad_id] if blocked else token_map[tok]
        product = c * mult[s]
        assert product < 2**63
        products.append(product)
    ids = []
    roll = products[0]
    for n in range(1, len(row)):
        roll ^= products[n]
        for k, prime in enumerate(primes[n - 1]):
            ids.append(roll % prime + offsets[(n - 1) * len(primes[n - 1]) + k])
    return ids


def _random_rows(rng: random.Random, vocab: int, image_id: int, count: int) -> list[list[int]]:
    rows = []
    for _ in range(count):
        row = [rng.randrange(vocab) for _ in range(4)]
        for s in range(4):
            if rng.random() < 0.1:
                row[s] = BLOCKED_TOKEN
            elif rng.random() < 0.1:
                row[s] = image_id
        rows.append(row)
    return rows


@pytest.mark.parametrize(
    ("layer_ids", "engram_vocab", "heads", "vocab", "compressed", "image_id"),
    [([1, 14], 16_000_000, 8, 129280, REAL_COMPRESSED, 129264), ([0, 1], 1000, 2, 1024, 700, 1001)],
)
def test_hash_matches_scalar_reference(layer_ids, engram_vocab, heads, vocab, compressed, image_id):
    rng = random.Random(1234)
    token_map = [rng.randrange(compressed) for _ in range(vocab)]
    token_map[5] = compressed - 1  # largest products: overflow would show up here
    rows = _random_rows(rng, vocab, image_id, 400) + [[5, 5, 5, 5], [-1, -1, -1, -1]]
    map_t = torch.tensor(token_map)
    rows_t = torch.tensor(rows)
    for tables in build_engram_hash_tables(layer_ids, engram_vocab, 4, heads, compressed):
        for image in (image_id, None):
            got = engram_hash_ids(rows_t, map_t, tables, pad_id=2, image_token_id=image)
            assert got.dtype == torch.int64 and got.shape == (len(rows), 3 * heads)
            expected = [_reference_hash(r, token_map, tables, 2, image) for r in rows]
            assert got.tolist() == expected
            assert int(got.min()) >= 0 and int(got.max()) < tables.num_rows


def test_blocking_at_sequence_start_and_image():
    (tables,) = build_engram_hash_tables([1], 16_000_000, 4, 8, REAL_COMPRESSED)
    token_map = torch.arange(129280) % REAL_COMPRESSED
    image = 129264
    seq = torch.tensor([100, 200, image, 300, 400, 500, 600])
    ids = engram_hash_ids(lookback_matrix(seq, 4), token_map, tables, image_token_id=image)
    # The image row sees only pads; rows after it equal a fresh sequence starting after it.
    all_pad = torch.tensor([[2, 2, 2, 2]])
    assert torch.equal(ids[2], engram_hash_ids(all_pad, token_map, tables)[0])
    fresh = engram_hash_ids(lookback_matrix(seq[3:], 4), token_map, tables, image_token_id=image)
    assert torch.equal(ids[3:], fresh)
    # Changing tokens before the image never changes hashes after it.
    other = seq.clone()
    other[:2] = torch.tensor([7, 8])
    ids_other = engram_hash_ids(lookback_matrix(other, 4), token_map, tables, image_token_id=image)
    assert torch.equal(ids[2:], ids_other[2:])
    # Without an image id the image token is an ordinary token.
    plain = engram_hash_ids(lookback_matrix(seq, 4), token_map, tables)
    assert not torch.equal(plain[3:], ids[3:])


def test_hash_rejects_wrong_shapes():
    (tables,) = build_engram_hash_tables([0], 1000, 4, 2, 700)
    token_map = torch.arange(1024) % 700
    with pytest.raises(ValueError):
        engram_hash_ids(torch.zeros(3, 3, dtype=torch.int64), token_map, tables)
    with pytest.raises(ValueError):
        engram_hash_ids(torch.zeros(3, 4, dtype=torch.int32), token_map, tables)


@pytest.mark.gpu
def test_hash_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = random.Random(7)
    token_map = torch.tensor([rng.randrange(REAL_COMPRESSED) for _ in range(129280)])
    rows = torch.tensor(_random_rows(rng, 129280, 129264, 4096))
    for tables in build_engram_hash_tables([1, 14], 16_000_000, 4, 8, REAL_COMPRESSED):
        cpu = engram_hash_ids(rows, token_map, tables, image_token_id=129264)
        gpu = engram_hash_ids(
            rows.cuda(), token_map.cuda(), tables.to("cuda"), image_token_id=129264
        )
        assert torch.equal(gpu.cpu(), cpu)


# ---------------------------------------------------------------------------- token map


def _word_level(tokens: list[str]) -> Tokenizer:
    return Tokenizer(
        models.WordLevel({tok: i for i, tok in enumerate(tokens)}, unk_token=tokens[0])
    )


def test_token_map_rule_on_handmade_tokens():
    tokens_and_ids = [
        ("Hello", 0),  # -> "hello"
        ("hello", 0),
        (" HÉLLO\t", 0),  # accent, case and surrounding whitespace go
        (" ", 1),  # a lone space survives the strip
        ("\n", 1),  # collapses to a lone space
        (" \r\n\t ", 1),
        ("ﬁ", 2),  # NFKC -> "fi"
        ("fi", 2),
        ("\u0301", 3),  # normalises to "" -> keyed by its decoded text
        ("x y", 4),
        ("X \n Y", 4),
        ("a\ufffd", 5),  # U+FFFD: keyed by the raw token, not normalised ...
        ("A\ufffd", 6),  # ... so case is not folded
    ]
    tokenizer = _word_level([tok for tok, _ in tokens_and_ids])
    token_map = build_compressed_token_map(tokenizer, len(tokens_and_ids))
    assert token_map.tolist() == [cid for _, cid in tokens_and_ids]
    assert token_map.dtype == np.int64
    with pytest.raises(ValueError):
        build_compressed_token_map(tokenizer, len(tokens_and_ids) + 1)


def test_token_map_digest():
    values = np.array([0, 1, 2, 700], dtype=np.int64)
    assert token_map_digest(values) == hashlib.sha256(values.astype("<i8").tobytes()).hexdigest()
    assert token_map_digest(values) == token_map_digest(values.astype(np.int32))
    assert token_map_digest(values) != token_map_digest(values[::-1])
    assert len(token_map_digest(values)) == 64


@pytest.fixture(scope="module")
def v4_token_map() -> np.ndarray:
    tokenizer = Tokenizer.from_file(str(v4_tokenizer_json_path()))
    return build_compressed_token_map(tokenizer, 129280)


@pytest.fixture(scope="module")
def v41_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("v41_for_map")
    write_v41_tokenizer(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_real_v4_token_map(v4_token_map: np.ndarray):
    assert v4_token_map.shape == (129280,)
    assert int(v4_token_map.max()) + 1 == REAL_COMPRESSED
    # First-appearance order: every new id is exactly one above the running maximum.
    running_max = np.maximum.accumulate(v4_token_map)
    assert np.all(np.diff(running_max) <= 1) and v4_token_map[0] == 0
    assert token_map_digest(v4_token_map) == REAL_MAP_DIGEST


def test_real_v41_token_map(v41_tokenizer: Tokenizer, v4_token_map: np.ndarray):
    token_map = build_compressed_token_map(v41_tokenizer, 129280)
    assert int(token_map.max()) + 1 == REAL_COMPRESSED
    np.testing.assert_array_equal(token_map, v4_token_map)


def test_partial_utf8_tokens_keep_distinct_ids(v41_tokenizer: Tokenizer, v4_token_map: np.ndarray):
    partial = [
        i
        for i in range(256, 3000)
        if "\ufffd" in v41_tokenizer.decode([i], skip_special_tokens=False)
    ]
    assert len(partial) > 10
    assert len(set(v4_token_map[partial].tolist())) == len(partial)
