"""The fixed-reduction-order matmul against its torch reference, and its row invariance."""

from __future__ import annotations

import re

import pytest
import torch

from kernels.invariant_matmul import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    invariant_matmul,
    invariant_matmul_reference,
)
from tests.kernels.interpreted import compile_for_hopper, run_interpreted, ulps

# (M, K, N): tile edges on every side, K not a multiple of BLOCK_K, one row, empty rows.
SHAPES = [(1, 64, 32), (3, 96, 72), (65, 40, 130), (130, 256, 24), (0, 64, 32)]

_INTERPRETED = """
import json, torch
from kernels.invariant_matmul import invariant_matmul, invariant_matmul_reference
from tests.kernels.interpreted import ulps
from tests.kernels.test_invariant_matmul import SHAPES
g = torch.Generator().manual_seed(0)
errors, row_changes = [], []
for m, k, n in SHAPES:
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    terms = x.abs() @ w.abs().t()
    errors.append(ulps(invariant_matmul(x, w), invariant_matmul_reference(x, w), terms))
    # Row invariance: the same rows alone, as a prefix, and behind other rows.
    big = torch.randn(m + 77, k, generator=g)
    big[50 : 50 + m] = x
    alone, inside = invariant_matmul(x, w), invariant_matmul(big, w)[50 : 50 + m]
    row_changes.append(int((alone != inside).sum()))
print(json.dumps([errors, row_changes]))
"""


def test_kernel_matches_reference_and_rows_ignore_the_batch_in_the_triton_interpreter() -> None:
    errors, row_changes = run_interpreted(_INTERPRETED, rows_alone=True)
    assert len(errors) == len(SHAPES) and max(errors) < 8, errors
    assert row_changes == [0] * len(SHAPES)


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        invariant_matmul(torch.zeros(3, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="share"):
        invariant_matmul(torch.zeros(3, 8), torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit column stride"):
        invariant_matmul(torch.zeros(8, 3).t(), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="CUDA"):
        invariant_matmul(torch.zeros(3, 8), torch.zeros(4, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (300, 5120, 1280), (7, 1280, 8192)])
def test_kernel_matches_reference_and_rows_ignore_the_batch_on_cuda(
    m: int, k: int, n: int, dtype: torch.dtype
) -> None:
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = torch.randn(n, k, device="cuda").to(dtype)
    ours = invariant_matmul(x, w)
    terms = (x.float().abs() @ w.float().abs().t()).to(dtype)
    assert ulps(ours, invariant_matmul_reference(x, w), terms) < 8
    for rows in (1, 8, 64, 257):
        big = torch.randn(rows + m, k, device="cuda").to(dtype)
        big[rows // 2 : rows // 2 + m] = x
        assert torch.equal(invariant_matmul(big, w)[rows // 2 : rows // 2 + m], ours)


# ---- compiled for sm90 without a GPU: the instructions the CUDA run will use ------------------

_TYPES = {name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")}
_ALIGNED = {"x_ptr", "w_ptr", "out_ptr", "K", "stride_xm", "stride_wn", "stride_om"}
_TILES = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}


@pytest.mark.parametrize(("dtype", "dot"), [("bf16", "wgmma.mma_async"), ("fp32", "fma.rn.f32")])
def test_kernel_compiles_for_hopper_without_atomics(dtype: str, dot: str) -> None:
    """bf16 runs on wgmma tensor cores, fp32 as IEEE FMAs (no TF32); no atomic or reduction
    instruction: nothing in the kernel can reorder a sum between runs."""
    from kernels.invariant_matmul import _invariant_matmul_kernel

    pointers = {name: f"*{dtype}" for name in ("x_ptr", "w_ptr", "out_ptr")}
    ptx = compile_for_hopper(_invariant_matmul_kernel, {**_TYPES, **pointers}, _TILES, _ALIGNED)
    assert dot in ptx
    assert not re.search(r"^\s*(@!?%\w+\s+)?(atom|red)\.", ptx, re.MULTILINE)
    if dtype == "fp32":
        assert not re.search(r"\b(w?gmma|mma)\.", ptx) and "tf32" not in ptx
