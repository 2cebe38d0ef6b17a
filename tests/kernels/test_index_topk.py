"""The indexer's one-launch top-k (`kernels.index_topk`) against torch's top-k.

The selection must be torch's: the same scores in the same best-first order (the attention sums
its rows in selection order), −1 in place of −inf scores, ties by the lower column. The kernel's
logic runs in Triton's CPU interpreter; the real sizes on CUDA are `gpu`-marked.
"""

from __future__ import annotations

import pytest
import torch

from kernels.index_topk import index_topk, index_topk_reference
from tests.kernels.interpreted import compile_for_hopper, run_interpreted

# (rows, J, k): a partial tile, several tiles, k = J, k = 1, the released k over a ratio-2 row
CASES = [(3, 100, 37), (2, 3000, 512), (4, 64, 64), (2, 10, 1), (2, 2048, 512)]


def scores_with_ties_and_holes(rows: int, width: int, seed: int) -> torch.Tensor:
    """Random scores; row 0 −inf at every third column (invisible positions), row 1 with a
    run of equal scores among its best, the last row (of three or more) all −inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    x[0, ::3] = float("-inf")
    if rows > 1:
        x[1, : width // 5] = 1.5
    if rows > 2:
        x[-1] = float("-inf")
    return x


def expected_selection(x: torch.Tensor, k: int) -> torch.Tensor:
    """The rule in plain torch: a stable descending sort (equal scores by column), −1 at −inf."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(torch.isfinite(x.gather(-1, order)), order, -1)


def _scores_of(x: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
    return torch.where(selection >= 0, x.gather(-1, selection.clamp(min=0)), -1e30)


def selections(cases, device: str = "cpu", resident_width: int = 0) -> list[list[bool]]:
    """Per case: [equal to the stable-sort rule, same scores in the same order as torch.topk]
    (resident_width: the launcher's)."""
    rows = []
    for seed, (num_rows, width, k) in enumerate(cases):
        x = scores_with_ties_and_holes(num_rows, width, seed).to(device)
        got = index_topk(x, k, resident_width=resident_width)
        reference = index_topk_reference(x, k)
        rows.append(
            [
                torch.equal(got.cpu(), expected_selection(x.cpu(), k)),
                torch.equal(_scores_of(x, got), _scores_of(x, reference)),
                got.dtype == torch.int64 and got.shape == (num_rows, k),
            ]
        )
    return rows


@pytest.mark.slow  # ~8 s in the interpreter
@pytest.mark.parametrize("resident_width", [0, 8192], ids=["streamed", "resident"])
def test_selection_is_torchs_in_the_triton_interpreter(resident_width: int) -> None:
    code = (
        "import json\n"
        "from tests.kernels.test_index_topk import CASES, selections\n"
        f"print(json.dumps(selections(CASES, resident_width={resident_width})))\n"
    )
    for case, row in zip(CASES, run_interpreted(code), strict=True):
        assert all(row), (case, row)


_EMPTY = """
import json, torch
from kernels.index_topk import index_topk
shapes = [tuple(index_topk(torch.randn(*lead, j), k).shape)
          for lead, j, k in (((2, 3), 0, 0), ((0,), 5, 2), ((2, 1), 7, 0))]
print(json.dumps(shapes))
"""


def test_empty_selections_in_the_triton_interpreter() -> None:
    # a step whose sequences see no compressed position yet (J = 0), a launch without rows
    assert run_interpreted(_EMPTY) == [[2, 3, 0], [0, 2], [2, 1, 0]]


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="fp32"):
        index_topk(x.double(), 4)
    with pytest.raises(ValueError, match="unit column stride"):
        index_topk(x.t(), 1)
    with pytest.raises(ValueError, match="k must be"):
        index_topk(x, 17)
    with pytest.raises(ValueError, match="resident_width"):
        index_topk(x, 4, resident_width=16384)
    with pytest.raises(ValueError, match="CUDA"):
        index_topk(x, 4)


@pytest.mark.parametrize("resident", [0, 4096])
def test_kernel_compiles_for_hopper(resident: int) -> None:
    from kernels.index_topk import _index_topk_kernel

    ptx = compile_for_hopper(
        _index_topk_kernel,
        {"x_ptr": "*fp32", "out_ptr": "*i64", "width": "i32", "row_stride": "i32", "k": "i32"},
        {"BLOCK": 1024, "K_PAD": 512, "RESIDENT": resident},
        {"x_ptr", "out_ptr"},
        {"num_warps": 8},
    )
    assert "st.global" in ptx and "bar.sync" in ptx


@pytest.mark.gpu
def test_selection_is_torchs_on_cuda() -> None:
    cases = CASES + [(256, 12288, 512), (256, 6144, 512), (16, 4096, 512), (1, 65536, 512)]
    cases += [(16, 8192, 512), (16, 2048, 512)]
    for resident_width in (0, 8192):
        rows = selections(cases, "cuda", resident_width)
        for case, row in zip(cases, rows, strict=True):
            assert all(row), (case, resident_width, row)
