"""RoPE of rows in one launch (`model.md` §3.3), as `apply_rope_reference` (below):

    angle = f32(pos) · f[i];  (x[2i], x[2i+1]) of the rotated tail ← (a·c − b·s, a·s + b·c)
    with c = cos(angle), s = ±sin(angle) (− for the inverse rotation), in fp32, cast back

The torch version is ~8 launches (angles, polar, casts, complex multiply, concatenation) and the
model rotates ~5 times per layer. cos and sin come from libdevice, the functions CUDA's cosf and
sinf (and so torch's `polar`) use. `cos_sin` and `rotate` are the two steps as device functions:
every kernel that rotates pairs (`kernels.rms_norm_rope`, ...) calls them, so it rounds as this
one does.

    grid (positions, rows per position / BLOCK_R): x viewed as [P, R, D], positions [P]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from kernels import check_runnable, interpreting
from kernels.rounding import round_to

__all__ = ["apply_rope", "apply_rope_reference", "cos_sin", "rotate"]

_BLOCK_R = 64  # rows per program at most: every head of a position's queries
# Triton's CPU interpreter has no libdevice; there tl.cos / tl.sin (numpy's) stand in.
_LIBDEVICE = not interpreting()


@triton.jit
def cos_sin(angle, sign, LIBDEVICE: tl.constexpr):
    """(cos(angle), sign · sin(angle)) in fp32: libdevice's (CUDA's cosf / sinf), or numpy's in
    the interpreter (`LIBDEVICE` False)."""
    if LIBDEVICE:
        return libdevice.cos(angle), libdevice.sin(angle) * sign
    return tl.cos(angle), tl.sin(angle) * sign


@triton.jit
def rotate(a, b, c, s):
    """The rotated pair (a·c − b·s, a·s + b·c) in fp32, unrounded.

    NOTE: spelled out as the fused multiply-adds fma(a, c, −b·s) and fma(b, c, a·s): the CUDA
    build contracts plain products its own way per kernel and dtype (sm90 PTX, Triton 3.9: this
    kernel's plain `a·c − b·s`, `a·s + b·c` became exactly these for bf16 rows, but fma(s, a,
    b·c) for the odd channel of fp32 rows), so every kernel that rotates a pair through here
    gets the same bits, and the interpreter (whose fma rounds once) the GPU's."""
    return tl.fma(a, c, -(b * s)), tl.fma(b, c, a * s)


@triton.jit
def _rope_kernel(
    x_ptr,
    position_ptr,
    freq_ptr,
    out_ptr,
    rows_per_position,
    width,
    pass_width,
    half,
    sign,
    BLOCK_R: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_row = rows < rows_per_position
    base = (p * rows_per_position + rows) * width  # [BLOCK_R]
    i = tl.arange(0, BLOCK_HALF)
    in_half = i < half
    angle = tl.load(position_ptr + p).to(tl.float32) * tl.load(freq_ptr + i, mask=in_half)
    c, s = cos_sin(angle, sign, LIBDEVICE)
    # the rotated tail as one contiguous [BLOCK_R, 2 · BLOCK_HALF] tile (wide loads and
    # stores), its pairs split in registers
    channels = tl.arange(0, 2 * BLOCK_HALF)
    mask = is_row[:, None] & (channels < 2 * half)[None, :]
    tail = base[:, None] + pass_width + channels[None, :]
    pairs = tl.reshape(tl.load(x_ptr + tail, mask=mask, other=0.0), [BLOCK_R, BLOCK_HALF, 2])
    a, b = tl.split(pairs.to(tl.float32))
    rotated_even, rotated_odd = rotate(a, b, c[None, :], s[None, :])
    dtype = out_ptr.dtype.element_ty
    rotated = tl.join(round_to(rotated_even, dtype), round_to(rotated_odd, dtype))
    tl.store(out_ptr + tail, tl.reshape(rotated, [BLOCK_R, 2 * BLOCK_HALF]).to(dtype), mask=mask)
    if BLOCK_PASS > 0:
        cols = tl.arange(0, BLOCK_PASS)
        kept = is_row[:, None] & (cols < pass_width)[None, :]
        offsets = base[:, None] + cols[None, :]
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=kept), mask=kept)


def apply_rope(
    x: Tensor, positions: Tensor, freqs: Tensor, inverse: bool = False, in_place: bool = False
) -> Tensor:
    """`apply_rope_reference` in one launch (same arguments: `positions` has `x`'s leading
    shape, any dimensions between it and the last one share its angle). in_place: x (which
    must be contiguous) is rotated and returned; only the rotated channels are read and
    written, not the ones that pass through.

    Raises:
        ValueError: positions that are not a leading shape of x, a rotated tail wider than x,
            a non-contiguous x in place, or not on CUDA.
    """
    width, half = x.shape[-1], freqs.numel()
    lead = positions.dim()
    if tuple(x.shape[:lead]) != tuple(positions.shape) or lead >= x.dim() or 2 * half > width:
        raise ValueError(
            f"positions {tuple(positions.shape)} must lead x {tuple(x.shape)}, whose last "
            f"dimension must hold the {2 * half} rotated channels"
        )
    check_runnable(x, "apply_rope")
    if in_place and not x.is_contiguous():
        raise ValueError("apply_rope in place needs a contiguous x")
    x = x.contiguous()
    out = x if in_place else torch.empty_like(x)
    num_positions = positions.numel()
    rows_per_position = x.numel() // max(1, num_positions * width)
    if x.numel():
        pass_width = width - 2 * half
        copied = pass_width if not in_place else 0
        block_r = min(_BLOCK_R, triton.next_power_of_2(rows_per_position))
        grid = (num_positions, triton.cdiv(rows_per_position, block_r))
        _rope_kernel[grid](
            x,
            positions.contiguous(),
            freqs.to(device=x.device, dtype=torch.float32).contiguous(),
            out,
            rows_per_position,
            width,
            pass_width,
            half,
            -1.0 if inverse else 1.0,
            BLOCK_R=block_r,
            BLOCK_PASS=triton.next_power_of_2(copied) if copied else 0,
            BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
            LIBDEVICE=_LIBDEVICE,
        )
    return out


def apply_rope_reference(
    x: Tensor, positions: Tensor, freqs: Tensor, inverse: bool = False
) -> Tensor:
    """Rotate the trailing `2·len(freqs)` channels of `x[..., D]` by `exp(±j·pos·f_i)`.

    Channels (2i, 2i+1) of the rotated tail form the complex number `a + jb` (interleaved /
    GPT-J style). `positions` has `x`'s leading shape up to the dims between it and the last one
    (e.g. `x[T, H, D]` with `positions[T]`). The angle `pos·f` is rounded to fp32 before
    cos/sin and the rotation is a complex64 multiply, as in the reference implementations
    (bit-identical rows matter: a 1-ulp difference can flip an FP4 rounding of a stored row).
    Returned in `x`'s dtype.
    """
    rot = 2 * freqs.numel()
    angles = positions.to(torch.float32)[..., None] * freqs.to(positions.device)
    cis = torch.polar(torch.ones_like(angles), angles)
    if inverse:
        cis = cis.conj()
    tail = torch.view_as_complex(x[..., -rot:].float().unflatten(-1, (-1, 2)).contiguous())
    while cis.dim() < tail.dim():
        cis = cis.unsqueeze(-2)
    rotated = torch.view_as_real(tail * cis).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rot], rotated), dim=-1)
