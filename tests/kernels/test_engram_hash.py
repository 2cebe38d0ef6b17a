"""The one-launch Engram hash against the torch form: the same int64 ids."""

from __future__ import annotations

import random

import pytest
import torch

from engine.models.deepseek_v41.engram_hash import (
    build_engram_hash_tables,
    engram_hash_ids_reference,
)
from kernels.engram_hash import engram_hash
from tests.kernels.interpreted import run_interpreted
from tests.models.test_engram_hash import REAL_COMPRESSED, _random_rows

# (layer ids, Engram vocab, heads, vocab, compressed vocab, image id, positions): the released
# layout (8 heads: a power of two), a small one with 3 heads (masked lanes), one position.
CASES = [
    ([1, 14], 16_000_000, 8, 129280, REAL_COMPRESSED, 129264, 300),
    ([0, 1], 1000, 3, 1024, 700, 1001, 70),
    ([2], 5000, 8, 2048, 900, 2000, 1),
]


def mismatching_ids(device: str = "cpu") -> list[int]:
    """Per case, layer and image setting: ids of the kernel that differ from the torch form's
    (rows of every kind: blocked look-backs, image tokens, the largest map value everywhere,
    everything blocked)."""
    result = []
    for layer_ids, engram_vocab, heads, vocab, compressed, image_id, count in CASES:
        rng = random.Random(count)
        token_map = torch.tensor([rng.randrange(compressed) for _ in range(vocab)])
        token_map[5] = compressed - 1
        rows = _random_rows(rng, vocab, image_id, count - 1) + [[5, 5, 5, 5]]
        rows = torch.tensor(rows[:count] if count > 1 else [[-1, -1, -1, -1]])
        for tables in build_engram_hash_tables(layer_ids, engram_vocab, 4, heads, compressed):
            tables = tables.to(device)
            for image in (image_id, None):
                ours = engram_hash(
                    rows.to(device),
                    token_map.to(device),
                    tables.multipliers,
                    tables.primes,
                    tables.offsets,
                    2,
                    image,
                )
                reference = engram_hash_ids_reference(rows, token_map, tables.to("cpu"), 2, image)
                same_shape = ours.shape == reference.shape and ours.dtype == torch.int64
                result.append(int((ours.cpu() != reference).sum()) if same_shape else -1)
    return result


_INTERPRETED = """
import json
from tests.kernels.test_engram_hash import mismatching_ids
print(json.dumps(mismatching_ids()))
"""


def test_kernel_gives_the_torch_ids_in_the_triton_interpreter() -> None:
    result = run_interpreted(_INTERPRETED)
    assert len(result) == 2 * 5 and result == [0] * len(result)


def test_launcher_rejects_mismatched_inputs() -> None:
    (tables,) = build_engram_hash_tables([2], 5000, 4, 8, 900)
    rows = torch.zeros(3, 4, dtype=torch.int64)
    token_map = torch.zeros(2048, dtype=torch.int64)
    constants = (tables.multipliers, tables.primes, tables.offsets)
    with pytest.raises(ValueError, match="int64"):
        engram_hash(rows.int(), token_map, *constants, 2)
    with pytest.raises(ValueError, match=r"\[T, S\]"):
        engram_hash(rows[:, :3], token_map, *constants, 2)
    with pytest.raises(ValueError, match="primes"):
        engram_hash(rows, token_map, tables.multipliers, tables.primes[:2], tables.offsets, 2)
    with pytest.raises(ValueError, match="CUDA"):
        engram_hash(rows, token_map, *constants, 2)


@pytest.mark.gpu
def test_cuda_kernel_gives_the_torch_ids() -> None:
    assert mismatching_ids("cuda") == [0] * 10
