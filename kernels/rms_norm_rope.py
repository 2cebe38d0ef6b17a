"""RMSNorm, then RoPE of the normalised row, in one launch (`model.md` §3.1, §3.3):

    y = cast(f32(x) · rsqrt(mean(f32(x)²) + eps) · f32(w))          (`kernels.rms_norm`)
    out = y with its trailing 2·len(freqs) channels rotated by pos·f  (`kernels.rope`)

The attention normalises and then rotates the same rows several times a layer: its window row
(`kv_norm`), and in KV-source layers the compressed latent (`compressor.norm`) and the index
key (`indexer.k_norm`); two launches each before. The rotation reads the norm's output rounded to
the row's dtype, as the rope kernel reads it from memory, so the result is bit for bit
`apply_rope(rms_norm(x, w, eps), positions, freqs)` of the two kernels: the same `inv_rms` over
the same [BLOCK] row with rms_norm's num_warps (its NOTE), the same products, and the angle,
cos/sin and rotation through `kernels.rope`'s device functions. `keep_normed` also returns the
unrotated norm output (the compressor's latent feeds the index key's projection).

`rms_norm_rope_mxfp8` encodes the rotated row as an MXFP8 window row instead of storing it
(the window row's norm, RoPE and encoding in one launch; nothing else reads the rotated row):
the rounded channels the rope store would write, per block of 32 the scale of
`kernels.mxfp8_rows` (`scale_exponent`) and the e4m3 codes of the channels times 2^-s, so the
bytes are those of `mxfp8_rows_quantize(rms_norm_rope(...)[0])` (reference:
`kv_formats.swa_mxfp8_quantize`, which `kernels` cannot import).

    grid (rows,): one program per row of x [N, D], positions [N]; the row whole in registers
    for the norm, then as [D/2] even and odd halves for the pairs
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable, interpreting
from kernels.mxfp8_rows import AMAX_FLOOR, scale_exponent
from kernels.rms_norm import MAX_WIDTH, as_rows, inv_rms, norm_warps, rms_norm_reference
from kernels.rope import apply_rope_reference, cos_sin, rotate
from kernels.rounding import round_to
from kernels.row_codes import e4m3_code, pow2

__all__ = ["rms_norm_rope", "rms_norm_rope_mxfp8", "rms_norm_rope_reference"]

# Triton's CPU interpreter has no libdevice (`kernels.rope`).
_LIBDEVICE = not interpreting()
_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _normed_channels(x_ptr, weight_ptr, row_start, cols, mask, scale, dtype: tl.constexpr):
    """rms_norm's output at columns `cols` of one row, rounded to `dtype` (held as fp32): the
    kernel's `(x · scale) · w`, element by element."""
    x = tl.load(x_ptr + row_start + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return round_to(x * scale * weight, dtype)


@triton.jit
def _store_mxfp8_row(row_ptr, a, b, width, BLOCK: tl.constexpr, NEMO_FLOOR: tl.constexpr,
                     FLOOR: tl.constexpr):  # fmt: skip
    """One MXFP8 row at `row_ptr` (width e4m3 codes, then width / 32 scale bytes) of the
    channels held as even a and odd b [BLOCK / 2] (fp32 values of the row's dtype, zeros past
    width): block k is pairs 16k .. 16k + 15."""
    a = tl.reshape(a, (BLOCK // 32, 16))
    b = tl.reshape(b, (BLOCK // 32, 16))
    exponent = scale_exponent(tl.max(tl.maximum(tl.abs(a), tl.abs(b)), axis=1), NEMO_FLOOR, FLOOR)
    scale = pow2(-exponent)[:, None]
    blocks = tl.arange(0, BLOCK // 32)
    even = 32 * blocks[:, None] + 2 * tl.arange(0, 16)[None, :]
    tl.store(row_ptr + even, e4m3_code(a * scale).to(tl.uint8), mask=even < width)
    tl.store(row_ptr + even + 1, e4m3_code(b * scale).to(tl.uint8), mask=even < width)
    scale_bytes = (exponent + 127).to(tl.uint8)
    tl.store(row_ptr + width + blocks, scale_bytes, mask=blocks < width // 32)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr,
    weight_ptr,
    position_ptr,
    freq_ptr,
    out_ptr,
    normed_ptr,
    width,
    x_row_stride,
    pass_pairs,
    eps,
    copy_ptr,
    copy_row_ptr,
    BLOCK: tl.constexpr,
    KEEP_NORMED: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    MXFP8: tl.constexpr = False,
    ROW_DTYPE: tl.constexpr = None,
    NEMO_FLOOR: tl.constexpr = False,
    FLOOR: tl.constexpr = AMAX_FLOOR,
    COPY: tl.constexpr = False,
):
    """grid (rows,). MXFP8: out_ptr holds uint8 rows of width + width / 32 bytes, each the
    MXFP8 encoding (`_store_mxfp8_row`) of the rotated row in `ROW_DTYPE` (x's dtype), in
    place of that row; COPY (MXFP8 only): the encoding stored again at row copy_row[row] of
    copy_ptr's rows of the same width."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < width, other=0.0).to(tl.float32)
    scale = inv_rms(x, width, eps)  # rms_norm's reduction: the whole [BLOCK] row
    dtype = ROW_DTYPE if MXFP8 else out_ptr.dtype.element_ty
    pairs = tl.arange(0, BLOCK // 2)
    in_row = pairs < width // 2
    even = 2 * pairs
    a = _normed_channels(x_ptr, weight_ptr, row * x_row_stride, even, in_row, scale, dtype)
    b = _normed_channels(x_ptr, weight_ptr, row * x_row_stride, even + 1, in_row, scale, dtype)
    if KEEP_NORMED:
        tl.store(normed_ptr + row * width + even, a.to(dtype), mask=in_row)
        tl.store(normed_ptr + row * width + even + 1, b.to(dtype), mask=in_row)
    is_rotated = in_row & (pairs >= pass_pairs)
    freq = tl.load(freq_ptr + pairs - pass_pairs, mask=is_rotated, other=0.0)
    c, s = cos_sin(tl.load(position_ptr + row).to(tl.float32) * freq, 1.0, LIBDEVICE)
    rotated_even, rotated_odd = rotate(a, b, c, s)
    a = tl.where(is_rotated, round_to(rotated_even, dtype), a)
    b = tl.where(is_rotated, round_to(rotated_odd, dtype), b)
    if MXFP8:
        row_ptr = out_ptr + row * (width + width // 32)
        _store_mxfp8_row(row_ptr, a, b, width, BLOCK, NEMO_FLOOR, FLOOR)
        if COPY:
            copy_row = tl.load(copy_row_ptr + row).to(tl.int64)
            row_ptr = copy_ptr + copy_row * (width + width // 32)
            _store_mxfp8_row(row_ptr, a, b, width, BLOCK, NEMO_FLOOR, FLOOR)
    else:
        tl.store(out_ptr + row * width + even, a.to(dtype), mask=in_row)
        tl.store(out_ptr + row * width + even + 1, b.to(dtype), mask=in_row)


def rms_norm_rope(
    x: Tensor,
    weight: Tensor,
    eps: float,
    positions: Tensor,
    freqs: Tensor,
    keep_normed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(`apply_rope(rms_norm(x, weight, eps), positions, freqs)`, the unrotated
    `rms_norm(x, weight, eps)` when `keep_normed`, else None) in one launch, bit for bit the two
    kernels.

    x: [..., D] rows (strided rows too, as `rms_norm`); weight: [D]; positions: int [...],
    x's leading shape (one per row); freqs: fp32 [D_rot / 2], the rotated tail's frequencies
    (`rope_frequencies`). Outputs are contiguous.

    Raises:
        ValueError: positions not of x's leading shape, a weight of another width, rows wider
            than `rms_norm.MAX_WIDTH` or odd, a rotated tail wider than the row, or not on CUDA
            (or Triton's interpreter).
    """
    _check(x, weight, positions, freqs)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(out) if keep_normed else None
    _launch(x, weight, eps, positions, freqs, out, normed, {"KEEP_NORMED": keep_normed})
    return out, normed


def rms_norm_rope_mxfp8(
    x: Tensor,
    weight: Tensor,
    eps: float,
    positions: Tensor,
    freqs: Tensor,
    *,
    nemo_floor: bool = False,
    copy_to: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """`mxfp8_rows_quantize(rms_norm_rope(x, weight, eps, positions, freqs)[0], nemo_floor=...)`
    in one launch, bit for bit the two (`kernels.mxfp8_rows`): uint8 [..., D + D/32]. The
    rotated row itself is not written. copy_to (rows, index): each encoded row r also
    stored as rows[index[r]] (rows: contiguous uint8 [R, D + D/32], a KV ring's rows; index:
    int [x's rows], each row's own destination), in the same launch.

    Raises:
        ValueError: as `rms_norm_rope`, a row width that is not a multiple of 32, rows neither
            fp32 nor bf16, or copy_to rows of another width or an index of another length.
    """
    if x.shape[-1] % 32 or x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"MXFP8 rows are blocks of 32 of {tuple(_TRITON_DTYPES)}; got "
                         f"{x.dtype} rows of {x.shape[-1]}")  # fmt: skip
    width = x.shape[-1]
    row_bytes = width + width // 32
    options = {"KEEP_NORMED": False, "MXFP8": True, "NEMO_FLOOR": nemo_floor}
    options["ROW_DTYPE"] = _TRITON_DTYPES[x.dtype]
    if copy_to is not None:
        rows, index = copy_to
        good_rows = rows.dtype == torch.uint8 and rows.dim() == 2 and rows.is_contiguous()
        if not good_rows or rows.shape[1] != row_bytes or index.numel() != x[..., 0].numel():
            raise ValueError(f"copy_to: contiguous uint8 rows of {row_bytes} bytes and one "
                             f"index per row; got {rows.dtype} {tuple(rows.shape)}, index "
                             f"{tuple(index.shape)}")  # fmt: skip
        options |= {"COPY": True, "copy": (rows, index.reshape(-1).contiguous())}
    _check(x, weight, positions, freqs)
    out = torch.empty((*x.shape[:-1], row_bytes), dtype=torch.uint8, device=x.device)
    _launch(x, weight, eps, positions, freqs, out, None, options)
    return out


def _check(x: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor) -> None:
    """The layouts both launchers take (`rms_norm_rope`'s Raises)."""
    width, half = x.shape[-1], freqs.numel()
    if tuple(positions.shape) != tuple(x.shape[:-1]) or weight.shape != (width,):
        raise ValueError(
            f"need positions of x's leading shape and a weight of its width; got x "
            f"{tuple(x.shape)}, positions {tuple(positions.shape)}, weight {tuple(weight.shape)}"
        )
    if width > MAX_WIDTH or width % 2 or 2 * half > width:
        raise ValueError(f"rows of an even width up to {MAX_WIDTH} holding the {2 * half} "
                         f"rotated channels; got {width}")  # fmt: skip
    check_runnable(x, "rms_norm_rope")


def _launch(x, weight, eps, positions, freqs, out, normed, options) -> None:
    """One program per row of x into `out` (and `normed`, or out again when None)."""
    rows = as_rows(x)
    num_rows, width = rows.shape
    if not (num_rows and width):
        return
    block = triton.next_power_of_2(width)
    copy_rows, copy_index = options.pop("copy", (out, positions))
    _rms_norm_rope_kernel[(num_rows,)](
        rows,
        weight.contiguous(),
        positions.contiguous(),
        freqs.to(device=x.device, dtype=torch.float32).contiguous(),
        out,
        normed if normed is not None else out,
        width,
        rows.stride(0),
        width // 2 - freqs.numel(),
        eps,
        copy_rows,
        copy_index,
        BLOCK=block,
        LIBDEVICE=_LIBDEVICE,
        num_warps=norm_warps(block),  # rms_norm's: the same reduction
        **options,
    )


def rms_norm_rope_reference(
    x: Tensor,
    weight: Tensor,
    eps: float,
    positions: Tensor,
    freqs: Tensor,
    keep_normed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`rms_norm_rope` in plain torch: the two references in turn."""
    normed = rms_norm_reference(x, weight, eps)
    return apply_rope_reference(normed, positions, freqs), normed if keep_normed else None
