"""KV-cache row encodings of DeepSeek-V4.1 (model.md §2.3, §4, §14) as pure torch functions.

Three formats pack the LAST dimension of a float tensor ``x[..., D]`` into bytes and back:

=============  =========================  ================  ============  ==========
format         used for                   element           scale         D -> bytes
=============  =========================  ================  ============  ==========
``swa_mxfp8``  SWA rows (every layer)     e4m3, 1 byte      ue8m0 per 32  512 -> 528
``global_fp4`` compressed (global) KV     e2m1, 2 per byte  e4m3 per 16   512 -> 288
``index_fp4``  indexer keys and queries   e2m1, 2 per byte  ue8m0 per 32  128 -> 68
=============  =========================  ================  ============  ==========

Every format offers ``<fmt>_quantize(x) -> uint8[..., B]``, ``<fmt>_dequantize(packed, dtype)``,
``<fmt>_row_bytes(D)`` and ``<fmt>_round_trip(x)`` (bit-identical to dequantize(quantize(x)) in
x's dtype, without building the bytes). ``make_codec`` wraps one format (or exact float32
storage) in a ``KVCodec`` for the model and the cache. These functions are the references: on
the kernel path (``kernels.runs_kernels``) a codec encodes, decodes and round-trips with the
one-launch kernels of ``kernels.mxfp8_rows`` / ``kernels.fp4_rows``, bit-identical to them
(``tests/kernels/test_mxfp8_rows.py``, ``test_fp4_rows.py``).

All maths runs in float32 whatever the input dtype (float64 inputs are first rounded to float32).
Scales are exact powers of two or exact e4m3 values, so ``x / s`` and ``code * s`` are exact except
where the float32 quotient underflows far below the element grid. The functions are vectorised,
deterministic and identical on CPU and CUDA: no libm call (log2, exp2) is used; powers of two are
built from exponent bits and ``ceil(log2 v)`` is read exactly from ``frexp``.

Element formats used here (bytes on the wire):

* e4m3 (``torch.float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448, smallest
  subnormal 2^-9, no infinities, 0x7F/0xFF = NaN. Values are clamped to ±448 before every cast, so
  the encoding saturates instead of relying on the cast's overflow behaviour.
* e2m1 code (4 bits): bit 3 = sign, bits 0-2 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6};
  two codes per byte, the even element in the LOW nibble.
* ue8m0 byte b: the power of two 2^(b - 127) (b = 0 is 2^-127; b = 255 is NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache, partial

import torch
from torch import Tensor

from engine.models.deepseek_v41.primitives import apply_rope, rms_norm_rope
from kernels import runs_kernels
from kernels.fp4_rows import (
    global_fp4_rows_quantize,
    index_fp4_rows_dequantize,
    index_fp4_rows_quantize,
    index_fp4_rows_rotated_round_trip,
    index_fp4_rows_round_trip,
)
from kernels.mxfp8_rows import mxfp8_rows_quantize
from kernels.rms_norm_rope import rms_norm_rope_mxfp8

E4M3_MAX = 448.0
E2M1_MAX = 6.0
UE8M0_BIAS = 127
UE8M0_MIN_EXPONENT = -127
UE8M0_MAX_EXPONENT = 127

SWA_BLOCK = 32
GLOBAL_BLOCK = 16
INDEX_BLOCK = 32

SWA_AMAX_FLOOR = 1e-4  # floor of amax / 448 (spec) or of amax (NeMo), see swa_mxfp8_quantize
GLOBAL_SCALE_MIN = 2.0**-9  # smallest e4m3 subnormal
INDEX_AMAX_FLOOR = 6.0 * 2.0**-126

# e2m1 magnitudes by 3-bit code; codes 8..15 are the negated values (8 is -0.0).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding boundaries between consecutive magnitudes and whether a tie goes UP. Ties go to the
# even code (mantissa bit 0): 0.75 -> 1.0 (code 2), 1.75 -> 2.0 (4), 3.5 -> 4.0 (6); the other
# ties go down (0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2.0, 5.0 -> 4.0).
_E2M1_BOUNDARIES = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


# ------------------------------------------------------------------------------------------------
# Element and scale primitives (shared with weight_formats.py)
# ------------------------------------------------------------------------------------------------


def pow2(exponent: Tensor) -> Tensor:
    """Exact float32 powers of two.

    Args:
        exponent: integer tensor, values in [-149, 127] (ue8m0 needs only [-127, 127]).
    Returns:
        float32 tensor of the same shape, ``2 ** exponent``, built from IEEE bits (so it is exact
        on every device, including the float32 subnormals 2^-127 .. 2^-149).
    """
    e = exponent.to(torch.int32)
    one = torch.ones_like(e)
    normal_bits = (e + 127).clamp(min=1) << 23
    subnormal_bits = one << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal_bits, subnormal_bits).view(torch.float32)


def ceil_log2(v: Tensor, min_exponent: int, max_exponent: int) -> Tensor:
    """Exact ``ceil(log2(v))`` of a float32 tensor, clamped to [min_exponent, max_exponent].

    Args:
        v: float32 tensor, v >= 0. v == 0 (and NaN) map to ``min_exponent``; +inf maps to
           ``max_exponent``.
    Returns:
        int32 tensor of the same shape: the smallest e with v <= 2^e, clamped.

    NOTE: read from ``frexp`` (v = m * 2^E, m in [0.5, 1)): e = E - 1 when m == 0.5, else E. A
    float ``ceil(torch.log2(v))`` can miss by one for v a few ulps above a power of two.
    """
    mantissa, exponent = torch.frexp(v)
    e = exponent.to(torch.int32) - (mantissa == 0.5).to(torch.int32)
    e = torch.where(v > 0, e, min_exponent)
    e = torch.where(torch.isinf(v), max_exponent, e)
    return e.clamp(min_exponent, max_exponent)


def ue8m0_to_float(scale_bytes: Tensor) -> Tensor:
    """Decode ue8m0 bytes: uint8 b -> float32 2^(b - 127); b = 255 -> NaN."""
    b = scale_bytes.to(torch.int32)
    return torch.where(b == 255, float("nan"), pow2(b - UE8M0_BIAS))


def e4m3_to_float(e4m3_bytes: Tensor) -> Tensor:
    """Decode e4m3 bytes (uint8 or torch.float8_e4m3fn, any shape) to float32 of the same shape."""
    if e4m3_bytes.dtype == torch.uint8:
        e4m3_bytes = e4m3_bytes.view(torch.float8_e4m3fn)
    return e4m3_bytes.to(torch.float32)


def e4m3_round(y: Tensor) -> Tensor:
    """Round float32 values to e4m3 (nearest, ties to even), saturating at ±448.

    Returns a torch.float8_e4m3fn tensor of the same shape; NaN stays NaN.
    NOTE: the clamp is load-bearing: a bare cast saturates on CPU (torch 2.13) but gives NaN for
    |y| >= 480 on CUDA (torch 2.11, H200).
    """
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(y: Tensor) -> Tensor:
    """Round float32 values to e2m1 codes (nearest, ties to even code), saturating at ±6.

    Args:
        y: float tensor, any shape.
    Returns:
        uint8 tensor of the same shape with codes 0..15 (bit 3 = sign bit of y, so -0.0 and small
        negatives that round to zero give code 8). NaN gives code 0 or 8.
    """
    magnitude = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for boundary, tie_goes_up in _E2M1_BOUNDARIES:
        above = magnitude >= boundary if tie_goes_up else magnitude > boundary
        code += above.to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """Decode e2m1 codes (uint8 0..15, any shape) to float32 values of the same shape."""
    return _e2m1_table(codes.device)[codes.to(torch.int64)]


@cache
def _e2m1_table(device: torch.device) -> Tensor:
    """The 16 e2m1 values by code, kept per device (built once: uploading it is a host wait)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([magnitudes, -magnitudes]).to(device)


def decode_e2m1_bytes(packed: Tensor) -> Tensor:
    """Decode packed e2m1 pairs: uint8/int8[..., n] -> float32[..., 2n] (even element = low nibble).

    Equal to ``e2m1_decode(unpack_nibbles(packed))`` through one 256-entry table lookup.
    """
    packed = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    every_byte = torch.arange(256, dtype=torch.uint8, device=packed.device)
    lut = e2m1_decode(unpack_nibbles(every_byte[:, None]))  # [256, 2]
    return lut[packed.to(torch.int64)].flatten(-2)


def pack_nibbles(codes: Tensor) -> Tensor:
    """Pack 4-bit codes along the last dim: uint8[..., 2n] -> uint8[..., n].

    Byte i = codes[..., 2i] | codes[..., 2i + 1] << 4 (the even element in the low nibble).
    """
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of ``pack_nibbles``: uint8[..., n] -> uint8[..., 2n]."""
    packed = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def _blocks(x: Tensor, block: int) -> Tensor:
    """float[..., D] -> float32[..., D // block, block]; D must be a positive multiple of block."""
    if not x.is_floating_point():
        raise TypeError(f"expected a floating tensor, got {x.dtype}")
    _check_dim(x.shape[-1] if x.dim() > 0 else 0, block)
    return x.to(torch.float32).unflatten(-1, (-1, block))


def _check_dim(dim: int, multiple: int) -> None:
    if dim <= 0 or dim % multiple != 0:
        raise ValueError(f"row width {dim} must be a positive multiple of {multiple}")


def _split_row(
    packed: Tensor, data_bytes_per_unit: int, scale_bytes_per_unit: int
) -> tuple[Tensor, Tensor]:
    """Split uint8[..., B] rows into (data, scale) bytes; B must be a multiple of one unit."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed rows must be uint8, got {packed.dtype}")
    unit = data_bytes_per_unit + scale_bytes_per_unit
    width = packed.shape[-1] if packed.dim() > 0 else 0
    if width <= 0 or width % unit != 0:
        raise ValueError(f"packed row width {width} is not a positive multiple of {unit}")
    num_data = width // unit * data_bytes_per_unit
    return packed[..., :num_data], packed[..., num_data:]


# ------------------------------------------------------------------------------------------------
# MXFP8 window rows ("V41"): e4m3 + ue8m0 per 32
# ------------------------------------------------------------------------------------------------


def swa_mxfp8_row_bytes(dim: int) -> int:
    """Bytes of one packed SWA row of width ``dim`` (a multiple of 32): dim + dim / 32."""
    _check_dim(dim, SWA_BLOCK)
    return dim + dim // SWA_BLOCK


def _swa_mxfp8_parts(x: Tensor, nemo_floor: bool) -> tuple[Tensor, Tensor]:
    """-> (e4m3 elements [..., D/32, 32], int32 scale exponents [..., D/32, 1])."""
    blocks = _blocks(x, SWA_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if nemo_floor:
        ratio = amax.clamp_min(SWA_AMAX_FLOOR) / E4M3_MAX
    else:
        ratio = (amax / E4M3_MAX).clamp_min(SWA_AMAX_FLOOR)
    exponent = ceil_log2(ratio, UE8M0_MIN_EXPONENT, UE8M0_MAX_EXPONENT)
    return e4m3_round(blocks / pow2(exponent)), exponent


def swa_mxfp8_quantize(x: Tensor, *, nemo_floor: bool = False) -> Tensor:
    """Quantize SWA rows to MXFP8: float[..., D] -> uint8[..., D + D/32] (D a multiple of 32).

    Per block of 32 consecutive elements with amax = max |x|:
        spec (default):     s = 2^ceil(log2(max(amax / 448, 1e-4)))
        nemo_floor=True:    s = 2^ceil(log2(max(amax, 1e-4) / 448))   (model.md §14 difference 2;
                            differs only for blocks with amax < 0.0448)
        element = e4m3(x / s), round to nearest even, saturating at ±448.

    Row layout (D = 512 -> 528 bytes)::

        | e4m3 x[0] | e4m3 x[1] | ... | e4m3 x[D-1] | ue8m0 s[0] | ... | ue8m0 s[D/32-1] |
          byte 0                        byte D-1      byte D             byte D + D/32 - 1
        element j is scaled by byte D + j // 32
    """
    elements, exponent = _swa_mxfp8_parts(x, nemo_floor)
    data = elements.view(torch.uint8).flatten(-2)
    scale = (exponent + UE8M0_BIAS).to(torch.uint8).squeeze(-1)
    return torch.cat([data, scale], dim=-1)


def swa_mxfp8_dequantize(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode uint8[..., 33 * D / 32] MXFP8 rows to ``dtype[..., D]``: e4m3(byte) * 2^(s - 127)."""
    data, scale = _split_row(packed, SWA_BLOCK, 1)
    elements = e4m3_to_float(data).unflatten(-1, (-1, SWA_BLOCK))
    return (elements * ue8m0_to_float(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def swa_mxfp8_round_trip(x: Tensor, *, nemo_floor: bool = False) -> Tensor:
    """``swa_mxfp8_dequantize(swa_mxfp8_quantize(x), x.dtype)`` without building the bytes."""
    elements, exponent = _swa_mxfp8_parts(x, nemo_floor)
    return (elements.to(torch.float32) * pow2(exponent)).flatten(-2).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# FP4 global rows ("V41_FP4"): e2m1 + e4m3 scale per 16
# ------------------------------------------------------------------------------------------------


def global_fp4_row_bytes(dim: int) -> int:
    """Bytes of one packed global-KV row of width ``dim`` (a multiple of 16): dim/2 + dim/16."""
    _check_dim(dim, GLOBAL_BLOCK)
    return dim // 2 + dim // GLOBAL_BLOCK


def _e4m3_round_unbounded(v: Tensor) -> Tensor:
    """Positive float32 -> nearest value with 3 mantissa bits (ties to even), no 448 ceiling.

    Equals e4m3 rounding up to 448; above, keeps rounding to 3 mantissa bits (464 still -> 448).
    """
    bits = v.view(torch.int32)
    half_ulp = 0x7FFFF + ((bits >> 20) & 1)
    wide = ((bits + half_ulp) & ~0xFFFFF).view(torch.float32)
    return torch.where(v > E4M3_MAX, wide, e4m3_round(v).to(torch.float32))


def _global_fp4_parts(x: Tensor, clamp_scale: bool) -> tuple[Tensor, Tensor]:
    """-> (e2m1 codes uint8 [..., D/16, 16], float32 e4m3-valued scales [..., D/16, 1])."""
    blocks = _blocks(x, GLOBAL_BLOCK)
    ratio = blocks.abs().amax(dim=-1, keepdim=True) / E2M1_MAX
    if clamp_scale:
        scale = e4m3_round(ratio.clamp(GLOBAL_SCALE_MIN, E4M3_MAX)).to(torch.float32)
    else:
        scale = _e4m3_round_unbounded(ratio.clamp_min(GLOBAL_SCALE_MIN))
    return e2m1_encode((blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)), scale


def global_fp4_quantize(x: Tensor, *, clamp_scale: bool = True) -> Tensor:
    """Quantize global-KV rows to "V41_FP4": float[..., D] -> uint8[..., D/2 + D/16].

    Per block of 16 consecutive elements with amax = max |x|:
        s = e4m3_rne(clamp(amax / 6, 2^-9, 448));  code = rne_e2m1(clamp(x / s, -6, 6))
    ``clamp_scale=False`` drops the 448 ceiling (NeMo, model.md §14 difference 3): the scale is
    then amax/6 rounded to 3 mantissa bits, which differs from the spec only for amax > 2784
    (amax/6 > 464). Such a scale has no e4m3 byte, so quantize raises ValueError for it (a device
    sync is paid only in this mode); ``global_fp4_round_trip`` handles it.

    Row layout (D = 512 -> 288 bytes)::

        | c1<<4|c0 | c3<<4|c2 | ... | c[D-1]<<4|c[D-2] | e4m3 s[0] | ... | e4m3 s[D/16-1] |
          byte 0                      byte D/2-1         byte D/2
        element j: nibble (j % 2) of byte j // 2, scaled by byte D/2 + j // 16
    """
    codes, scale = _global_fp4_parts(x, clamp_scale)
    if not clamp_scale and bool((scale > E4M3_MAX).any()):
        raise ValueError("an FP4 block scale above 448 has no e4m3 byte (amax > 2784)")
    data = pack_nibbles(codes.flatten(-2))
    scale_bytes = e4m3_round(scale).view(torch.uint8).squeeze(-1)
    return torch.cat([data, scale_bytes], dim=-1)


def global_fp4_dequantize(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode uint8[..., 9 * D / 16] "V41_FP4" rows to ``dtype[..., D]``: e2m1(code) * e4m3(s)."""
    data, scale = _split_row(packed, GLOBAL_BLOCK // 2, 1)
    values = decode_e2m1_bytes(data).unflatten(-1, (-1, GLOBAL_BLOCK))
    return (values * e4m3_to_float(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def global_fp4_round_trip(x: Tensor, *, clamp_scale: bool = True) -> Tensor:
    """``global_fp4_dequantize(global_fp4_quantize(x), x.dtype)`` without building the bytes.

    Also defined where quantize raises (clamp_scale=False with a scale above 448).
    """
    codes, scale = _global_fp4_parts(x, clamp_scale)
    return (e2m1_decode(codes) * scale).flatten(-2).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# FP4 index keys / queries: e2m1 + ue8m0 per 32
# ------------------------------------------------------------------------------------------------


def index_fp4_row_bytes(dim: int) -> int:
    """Bytes of one packed index row of width ``dim`` (a multiple of 32): dim/2 + dim/32."""
    _check_dim(dim, INDEX_BLOCK)
    return dim // 2 + dim // INDEX_BLOCK


def _index_fp4_parts(x: Tensor) -> tuple[Tensor, Tensor]:
    """-> (e2m1 codes uint8 [..., D/32, 32], int32 scale exponents [..., D/32, 1])."""
    blocks = _blocks(x, INDEX_BLOCK)
    ratio = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(INDEX_AMAX_FLOOR) / E2M1_MAX
    exponent = ceil_log2(ratio, UE8M0_MIN_EXPONENT, UE8M0_MAX_EXPONENT)
    return e2m1_encode((blocks / pow2(exponent)).clamp(-E2M1_MAX, E2M1_MAX)), exponent


def index_fp4_quantize(x: Tensor) -> Tensor:
    """Quantize indexer keys/queries to FP4: float[..., D] -> uint8[..., D/2 + D/32].

    Per block of 32 consecutive elements with amax = max |x|:
        s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6));  code = rne_e2m1(x / s)  (|x / s| <= 6)
    NeMo computes the same rule (no §14 difference).

    Row layout (D = 128 -> 68 bytes)::

        | c1<<4|c0 | ... | c[D-1]<<4|c[D-2] | ue8m0 s[0] | ... | ue8m0 s[D/32-1] |
          byte 0           byte D/2-1         byte D/2
        element j: nibble (j % 2) of byte j // 2, scaled by byte D/2 + j // 32
    """
    codes, exponent = _index_fp4_parts(x)
    data = pack_nibbles(codes.flatten(-2))
    scale = (exponent + UE8M0_BIAS).to(torch.uint8).squeeze(-1)
    return torch.cat([data, scale], dim=-1)


def index_fp4_dequantize(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode uint8[..., 17 * D / 32] index rows to ``dtype[..., D]``: e2m1(code) * 2^(s - 127)."""
    data, scale = _split_row(packed, INDEX_BLOCK // 2, 1)
    values = decode_e2m1_bytes(data).unflatten(-1, (-1, INDEX_BLOCK))
    return (values * ue8m0_to_float(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def index_fp4_round_trip(x: Tensor) -> Tensor:
    """``index_fp4_dequantize(index_fp4_quantize(x), x.dtype)`` without building the bytes."""
    codes, exponent = _index_fp4_parts(x)
    return (e2m1_decode(codes) * pow2(exponent)).flatten(-2).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Codec: how the model stores one kind of KV row
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVCodec:
    """Stores rows of one KV kind, quantized or exact.

    ``encode``: float[..., dim] -> storage_dtype[..., row_width] (a new tensor, except exact
    storage of a float32 input, which may alias it).
    ``decode``: storage_dtype[..., row_width] -> float32[..., dim].
    ``decode(encode(x))`` is what attention must read (model.md §2.3). Both raise ValueError on a
    last dimension other than ``dim`` / ``row_width`` and TypeError on a wrong storage dtype.
    ``row_sections``: the byte widths of a stored row's parts in order (data, then scales; one
    part for exact storage); the prefix cache's block layout stores each part as its own
    section (`cache.md` §1.3).
    ``round_trip(x)``: ``decode(encode(x))`` without building the stored rows where a kernel
    does it in one launch; ``rotated_round_trip(x, positions, freqs)`` the round trip of x's
    RoPE (the indexer's queries), in one launch with the rotation where a kernel does both;
    ``normed_rotated_encode(x, weight, eps, positions, freqs)`` the encoding of x's RMSNorm,
    then RoPE (the window row), in one launch where a kernel does all three.
    The ``kernel_*`` functions, where set, replace the torch ones for tensors on the kernel path
    (``kernels.runs_kernels``): the same results, bit for bit, in one launch.
    """

    name: str
    dim: int
    storage_dtype: torch.dtype
    row_width: int
    encode_fn: Callable[[Tensor], Tensor] = field(repr=False, compare=False)
    decode_fn: Callable[[Tensor], Tensor] = field(repr=False, compare=False)
    row_sections: tuple[int, ...] = ()
    kernel_encode_fn: Callable[[Tensor], Tensor] | None = field(
        default=None, repr=False, compare=False
    )
    kernel_decode_fn: Callable[[Tensor], Tensor] | None = field(
        default=None, repr=False, compare=False
    )
    kernel_round_trip_fn: Callable[[Tensor], Tensor] | None = field(
        default=None, repr=False, compare=False
    )
    kernel_rotated_round_trip_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = field(
        default=None, repr=False, compare=False
    )
    kernel_normed_rotated_encode_fn: Callable[..., Tensor] | None = field(
        default=None, repr=False, compare=False
    )

    def encode(self, x: Tensor) -> Tensor:
        self._check_width(x)
        if self.kernel_encode_fn is not None and runs_kernels(x):
            return self.kernel_encode_fn(x)
        return self.encode_fn(x)

    def decode(self, stored: Tensor) -> Tensor:
        if stored.dtype != self.storage_dtype:
            raise TypeError(f"{self.name}: stored rows must be {self.storage_dtype}")
        if stored.shape[-1] != self.row_width:
            raise ValueError(
                f"{self.name}: expected stored width {self.row_width}, got {stored.shape[-1]}"
            )
        if self.kernel_decode_fn is not None and runs_kernels(stored):
            return self.kernel_decode_fn(stored)
        return self.decode_fn(stored)

    def round_trip(self, x: Tensor) -> Tensor:
        """``decode(encode(x))`` (float32[..., dim])."""
        if self.kernel_round_trip_fn is not None and runs_kernels(x):
            self._check_width(x)
            return self.kernel_round_trip_fn(x)
        return self.decode(self.encode(x))

    def rotated_round_trip(self, x: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
        """``round_trip(apply_rope(x, positions, freqs))`` (float32[..., dim]; the arguments of
        `primitives.apply_rope`): one launch on the kernel path where a kernel does both (FP4
        index rows), bit for bit the two; else the rotation, then ``round_trip``."""
        if self.kernel_rotated_round_trip_fn is not None and runs_kernels(x):
            self._check_width(x)
            return self.kernel_rotated_round_trip_fn(x, positions, freqs)
        return self.round_trip(apply_rope(x, positions, freqs))

    def normed_rotated_encode(
        self,
        x: Tensor,
        weight: Tensor,
        eps: float,
        positions: Tensor,
        freqs: Tensor,
        copy_to: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``encode(rms_norm_rope(x, weight, eps, positions, freqs)[0])`` (the arguments of
        `primitives.rms_norm_rope`): one launch on the kernel path where a kernel does the
        norm, the rotation and the encoding (MXFP8 window rows), bit for bit the two launches;
        else the norm and rotation, then ``encode``. copy_to (rows, index): the encoded rows
        also stored as rows[index] (rows [R, row bytes]: a ring's rows; in the same launch
        where the kernel encodes)."""
        if self.kernel_normed_rotated_encode_fn is not None and runs_kernels(x):
            self._check_width(x)
            fn = self.kernel_normed_rotated_encode_fn
            return fn(x, weight, eps, positions, freqs, copy_to=copy_to)
        encoded = self.encode(rms_norm_rope(x, weight, eps, positions, freqs)[0])
        if copy_to is not None:
            rows, index = copy_to
            rows[index] = encoded
        return encoded

    def _check_width(self, x: Tensor) -> None:
        if x.shape[-1] != self.dim:
            raise ValueError(f"{self.name}: expected rows of width {self.dim}, got {x.shape[-1]}")


@dataclass(frozen=True)
class _KVFormat:
    quantize: Callable[..., Tensor]
    dequantize: Callable[..., Tensor]
    row_bytes: Callable[[int], int]
    nemo_kwargs: Mapping[str, bool]  # keyword arguments of quantize selecting the NeMo variant
    scale_block: int  # elements per scale byte: a row is dim / 2 or dim data bytes, then scales
    kernel_quantize: Callable[..., Tensor]  # the same keyword arguments as quantize
    kernel_dequantize: Callable[[Tensor], Tensor] | None = None  # -> float32
    kernel_round_trip: Callable[[Tensor], Tensor] | None = None  # -> float32
    kernel_rotated_round_trip: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None
    # the same keyword arguments as quantize
    kernel_normed_rotated_quantize: Callable[..., Tensor] | None = None


_KV_FORMATS: Mapping[str, _KVFormat] = {
    "swa_mxfp8": _KVFormat(
        swa_mxfp8_quantize,
        swa_mxfp8_dequantize,
        swa_mxfp8_row_bytes,
        {"nemo_floor": True},
        SWA_BLOCK,
        mxfp8_rows_quantize,
        kernel_normed_rotated_quantize=rms_norm_rope_mxfp8,
    ),
    "global_fp4": _KVFormat(
        global_fp4_quantize,
        global_fp4_dequantize,
        global_fp4_row_bytes,
        {"clamp_scale": False},
        GLOBAL_BLOCK,
        global_fp4_rows_quantize,
    ),
    "index_fp4": _KVFormat(
        index_fp4_quantize,
        index_fp4_dequantize,
        index_fp4_row_bytes,
        {},
        INDEX_BLOCK,
        index_fp4_rows_quantize,
        index_fp4_rows_dequantize,
        partial(index_fp4_rows_round_trip, dtype=torch.float32),
        partial(index_fp4_rows_rotated_round_trip, dtype=torch.float32),
    ),
}

KV_KINDS = tuple(_KV_FORMATS)


def _to_float32(x: Tensor) -> Tensor:
    return x.to(torch.float32)


def make_codec(kind: str, dim: int, quantize: bool = True, nemo_variant: bool = False) -> KVCodec:
    """Build the codec for one KV kind.

    Args:
        kind: one of ``KV_KINDS`` ("swa_mxfp8", "global_fp4", "index_fp4").
        dim: row width D (a multiple of the format's block when ``quantize``).
        quantize: False stores float32 rows unchanged (row_width = dim, exact mode).
        nemo_variant: use NeMo AutoModel's scale rules (model.md §14: the SWA floor, the unclamped
            FP4 global scale; index rows have no difference). No effect on exact storage.
    Returns:
        A KVCodec named ``kind``, ``kind + "/nemo"`` or ``kind + "/exact"``.
    Raises:
        ValueError: unknown kind, or dim not a multiple of the format's block.
    """
    fmt = _KV_FORMATS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown KV kind {kind!r}; expected one of {KV_KINDS}")
    if not quantize:
        _check_dim(dim, 1)
        exact = (dim * 4,)
        return KVCodec(
            f"{kind}/exact", dim, torch.float32, dim, _to_float32, _to_float32, row_sections=exact
        )
    kwargs = fmt.nemo_kwargs if nemo_variant else {}
    width = fmt.row_bytes(dim)
    num_scales = dim // fmt.scale_block
    return KVCodec(
        name=f"{kind}/nemo" if nemo_variant else kind,
        dim=dim,
        storage_dtype=torch.uint8,
        row_width=width,
        encode_fn=partial(fmt.quantize, **kwargs),
        decode_fn=fmt.dequantize,
        row_sections=(width - num_scales, num_scales),
        kernel_encode_fn=partial(fmt.kernel_quantize, **kwargs),
        kernel_decode_fn=fmt.kernel_dequantize,
        kernel_round_trip_fn=fmt.kernel_round_trip,
        kernel_rotated_round_trip_fn=fmt.kernel_rotated_round_trip,
        kernel_normed_rotated_encode_fn=(
            partial(fmt.kernel_normed_rotated_quantize, **kwargs)
            if fmt.kernel_normed_rotated_quantize is not None
            else None
        ),
    )
