"""Gathered Engram table rows, dequantised, in one launch (`model.md` §3.9):

    out[i, j] = cast_out(e4m3(W8[r_i, j]) · 2^(S[r_i, j / 32] − 127))     r_i = ids[i] (or i)

A table row holds D e4m3 bytes and D/32 ue8m0 scale bytes (255: NaN). The torch form
(`weight_formats.fp8_row_dequantize_reference`, which `tests/kernels/test_engram_rows.py`
compares bit for bit; `kernels` cannot import it) is ~18 launches: two gathers, the decodes,
the powers of two, the product, the cast. Both products are exact (an e4m3 value has four
significant bits) unless they leave float32's normal range; one rounding to the output dtype.

    grid (cdiv(rows, ROWS)): ROWS gathered rows of the whole width per program

NOTE: the ids are not range-checked (that would need a host sync); `engram_hash_ids` makes
them below the table's row count by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.rounding import round_to
from kernels.row_codes import e4m3_value, store_float32, ue8m0_value

__all__ = ["engram_rows"]

_ROWS = 8
_GROUP = 32


@triton.jit(do_not_specialize=["num_rows"])  # step-varying: one variant
def _engram_rows_kernel(
    weight_ptr,
    scale_ptr,
    ids_ptr,
    out_ptr,
    num_rows,
    DIM: tl.constexpr,
    HAS_IDS: tl.constexpr,
    BF16_OUT: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < num_rows
    if HAS_IDS:
        table_rows = tl.load(ids_ptr + rows, mask=live, other=0).to(tl.int64)
    else:
        table_rows = rows.to(tl.int64)
    groups = tl.arange(0, DIM // GROUP)
    scale_bytes = tl.load(
        scale_ptr + table_rows[:, None] * (DIM // GROUP) + groups[None, :], mask=live[:, None]
    ).to(tl.int32)
    scales = ue8m0_value(scale_bytes)  # [ROWS, DIM / GROUP]: one power of two per block
    cols = tl.arange(0, DIM)
    codes = tl.load(weight_ptr + table_rows[:, None] * DIM + cols[None, :], mask=live[:, None]).to(
        tl.int32
    )
    magnitude = codes & 0x7F
    value = tl.where(magnitude == 0x7F, float("nan"), e4m3_value(magnitude))
    value = (value.to(tl.int32, bitcast=True) | ((codes & 0x80) << 24)).to(tl.float32, bitcast=True)
    value = tl.reshape(value, (ROWS, DIM // GROUP, GROUP)) * scales[:, :, None]
    value = tl.reshape(value, (ROWS, DIM))
    offsets = rows.to(tl.int64)[:, None] * DIM + cols[None, :]
    if BF16_OUT:
        store_float32(out_ptr, offsets, round_to(value, tl.bfloat16), live[:, None], True)
    else:
        tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=live[:, None])


def engram_rows(weight: Tensor, scale: Tensor, ids: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Table `weight` uint8 [R, D] (e4m3 bytes) and `scale` uint8 [R, D/32] (ue8m0 bytes),
    int64 `ids` of any shape (None: every row in order) → dtype [*ids.shape, D] (bfloat16
    or float32)."""
    if weight.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError("weight and scale must be the uint8 views of the table's bytes")
    width = weight.shape[-1]
    if weight.dim() != 2 or width % _GROUP or width & (width - 1):
        raise ValueError(f"weight must be [rows, D] with D a power of two >= 32, got {width}")
    if scale.shape != (weight.shape[0], width // _GROUP):
        raise ValueError(f"scale {tuple(scale.shape)} does not match weight {tuple(weight.shape)}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"output dtype must be bfloat16 or float32, got {dtype}")
    if ids is not None and ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64, got {ids.dtype}")
    check_runnable(weight, "engram_rows")
    shape = (weight.shape[0],) if ids is None else tuple(ids.shape)
    out = torch.empty(*shape, width, dtype=dtype, device=weight.device)
    num_rows = out.numel() // width  # width >= 32, checked above
    if num_rows:
        flat_ids = ids.reshape(-1).contiguous() if ids is not None else weight
        _engram_rows_kernel[(triton.cdiv(num_rows, _ROWS),)](
            weight.contiguous(),
            scale.contiguous(),
            flat_ids,
            out.view(torch.int16) if dtype == torch.bfloat16 else out,
            num_rows,
            DIM=width,
            HAS_IDS=ids is not None,
            BF16_OUT=dtype == torch.bfloat16,
            ROWS=_ROWS,
            GROUP=_GROUP,
        )
    return out
