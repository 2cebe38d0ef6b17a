"""The tensor inventory reproduces the released checkpoint's published totals (`model.md` §5)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from engine.models.deepseek_v41.config import DeepseekV41Config, preset_config, preset_names
from engine.models.deepseek_v41.inventory import full_inventory

_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
# Vision tower, aligner and image delimiters (all BF16), which the text engine does not list.
_VISION_TENSORS = 266
_VISION_BYTES = 970_536_960


def _totals(cfg: DeepseekV41Config) -> tuple[Counter, int]:
    dtypes: Counter = Counter()
    total = 0
    for spec in full_inventory(cfg):
        shapes, kinds = spec.stored_shapes(cfg.fp8_block_size), spec.stored_dtypes()
        for name, shape in shapes.items():
            dtypes[kinds[name]] += 1
            total += math.prod(shape) * _BYTES[kinds[name]]
    return dtypes, total


def test_released_config_matches_published_inventory() -> None:
    dtypes, total = _totals(DeepseekV41Config())
    # Published: 96,085 tensors, {BF16: 520, F32: 387, F8_E4M3: 357, F8_E8M0: 47,589, I8: 47,232},
    # 510,286,023,000 bytes — less the 266 BF16 vision tensors.
    assert dtypes == Counter(
        {"BF16": 520 - _VISION_TENSORS, "F32": 387, "F8_E4M3": 357, "F8_E8M0": 47589, "I8": 47232}
    )
    assert sum(dtypes.values()) == 96085 - _VISION_TENSORS
    assert total == 510_286_023_000 - _VISION_BYTES


def test_medium_preset_is_about_95_gb() -> None:
    _, total = _totals(preset_config("medium"))
    assert 94e9 < total < 96e9  # model.md §11.2: ≈ 95 GB stored


@pytest.mark.parametrize("name", preset_names())
def test_presets_keep_the_released_structure(name: str) -> None:
    cfg = preset_config(name)
    assert cfg.ced_boundary == cfg.candidate_source_layer_id
    assert [cfg.kv_source_of(i) for i in range(cfg.num_hidden_layers)] == [
        None,
        1,
        1,
        3,
        4,
        4,
        4,
        4,
    ]
    assert [cfg.index_source_of(i) for i in range(cfg.num_hidden_layers)] == [
        None,
        1,
        1,
        3,
        4,
        4,
        6,
        6,
    ]
    assert [cfg.is_candidate_consumer(i) for i in range(8)] == [False] * 6 + [True, False]
    assert DeepseekV41Config.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_engram_rows_follow_the_prime_rule() -> None:
    assert preset_config("tiny").engram_num_embeddings == (6126, 6332)
    assert preset_config("medium").engram_num_embeddings == (48004402, 48011386)


def test_invalid_configs_are_rejected_with_a_reason() -> None:
    with pytest.raises(ValueError, match="compress_ratios"):
        preset_config("tiny", compress_ratios=(0, 2, 2))
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_config("huge")
    with pytest.raises(ValueError, match="ratio 0 or 1"):
        preset_config("tiny", compress_ratios=(0, 2, 2, 2, 1, 2, 1, 1, 0, 0, 0))
