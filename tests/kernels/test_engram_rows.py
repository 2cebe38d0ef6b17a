"""The one-launch gather and dequantise of Engram rows against the torch form, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.weight_formats import fp8_row_dequantize_reference
from kernels.engram_rows import engram_rows
from tests.kernels.interpreted import run_interpreted, same_bits

# (table rows, width, ids shape or None for every row, dtype name): the real lookup (24 rows of
# 256 per token), the smallest width, a single id, a flat run of ids in fp32, every row.
CASES = [(40, 256, (5, 24), "bfloat16"), (9, 32, (3, 4), "float32"), (12, 64, (), "bfloat16")]
CASES += [(17, 128, (0, 24), "bfloat16"), (20, 64, (33,), "float32"), (11, 64, None, "float32")]


def _inputs(case, device: str = "cpu"):
    """(weight bytes, scale bytes, ids): every e4m3 byte occurs (NaNs, ±0, subnormals,
    negatives), scale bytes around 127 plus the NaN scale 255, ids with repeats."""
    rows, width, ids_shape, _ = case
    generator = torch.Generator().manual_seed(rows * width)
    weight = torch.randint(0, 256, (rows, width), generator=generator, dtype=torch.int32)
    weight.view(-1)[:256] = torch.arange(min(256, weight.numel()), dtype=torch.int32)
    scale = torch.randint(110, 145, (rows, width // 32), generator=generator, dtype=torch.int32)
    scale[rows // 2, 0] = 255
    ids = None
    if ids_shape is not None:
        ids = torch.randint(0, rows, ids_shape, generator=generator)
    weight, scale = weight.to(torch.uint8).to(device), scale.to(torch.uint8).to(device)
    return weight, scale, None if ids is None else ids.to(device)


def mismatches(device: str = "cpu") -> list[bool]:
    """Per case: whether the kernel's rows have the torch form's bits."""
    result = []
    for case in CASES:
        weight, scale, ids = _inputs(case, device)
        dtype = getattr(torch, case[3])
        ours = engram_rows(weight, scale, ids, dtype)
        reference = fp8_row_dequantize_reference(weight, scale, ids, dtype)
        result.append(same_bits(ours.cpu(), reference.cpu()))
    return result


_INTERPRETED = """
import json
from tests.kernels.test_engram_rows import mismatches
print(json.dumps(mismatches()))
"""


def test_kernel_equals_the_torch_form_in_the_triton_interpreter() -> None:
    assert run_interpreted(_INTERPRETED) == [True] * len(CASES)


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    weight, scale, ids = _inputs(CASES[1])
    with pytest.raises(ValueError, match="uint8"):
        engram_rows(weight.view(torch.float8_e4m3fn), scale, ids, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        engram_rows(weight[:, :24], scale, ids, torch.float32)
    with pytest.raises(ValueError, match="does not match"):
        engram_rows(weight, scale[:-1], ids, torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        engram_rows(weight, scale, ids, torch.float16)
    with pytest.raises(ValueError, match="int64"):
        engram_rows(weight, scale, ids.int(), torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        engram_rows(weight, scale, ids, torch.float32)


@pytest.mark.gpu
def test_cuda_kernel_equals_the_torch_form() -> None:
    assert mismatches("cuda") == [True] * len(CASES)
