"""The in-register unpack's inline PTX (`kernels.mxfp4_unpack`), run here by a model of the few
PTX instructions it uses: its bits against the codecs of `kernels.element_codes`, for the two
places that multiply its output: the expert GEMMs (MXFP4: 2^(scale − 1), scales up to 128) and
the attention's FP4 rows (`sparse_mqa._unpacked_global_rows`: 2^118, then e4m3 scale · 2^8).
The kernels' `gpu` tests check the same on the GPU; this pins the strings and constants."""

from __future__ import annotations

import re

import torch

from kernels.element_codes import e4m3_to_float, fp4_rows_to_float, mxfp4_to_float
from kernels.mxfp4_unpack import UNPACK_0, UNPACK_1, UNPACK_2, UNPACK_3, reads_as_words
from kernels.sparse_mqa import _UNPACK_PRESCALE

_MASK = 0xFFFFFFFF


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def _bf16x2_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`mul.rn.bf16x2` of int64 tensors holding 32-bit registers."""
    halves = []
    for shift in (0, 16):
        x = _bf16_bits_to_float((a >> shift) & 0xFFFF) * _bf16_bits_to_float((b >> shift) & 0xFFFF)
        bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        halves.append(bits << shift)
    return halves[0] | halves[1]


def _run_ptx(asm: str, word: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    """The string's instructions ($0 out, $1 word, $2 multiplier) on int64 tensors."""
    registers = {"$1": word, "$2": multiplier}

    def value(operand: str) -> torch.Tensor | int:
        return registers[operand] if operand in registers else int(operand, 0)

    for instruction in re.findall(r"([a-z0-9.]+) ([^;]+);", asm.strip("{} ")):
        op, operands = instruction[0], [part.strip() for part in instruction[1].split(",")]
        if op == ".reg":
            continue
        out, args = operands[0], [value(operand) for operand in operands[1:]]
        if op == "shl.b32":
            result = (args[0] << args[1]) & _MASK
        elif op == "shr.b32":
            result = args[0] >> args[1]
        elif op == "and.b32":
            result = args[0] & args[1]
        elif op == "lop3.b32":
            assert args[3] == 0xF8  # a | (b & c)
            result = args[0] | (args[1] & args[2])
        elif op == "mul.rn.bf16x2":
            result = _bf16x2_product(args[0], args[1])
        else:
            raise AssertionError(f"no model of {op}")
        registers[out] = result
    return registers["$0"]


def _unpacked(
    words: torch.Tensor, multiplier: torch.Tensor, then: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [..., 8 · words] in value order: register j holds values j and j + 4 of its word;
    `then`: bf16x2 registers each output register is multiplied by afterwards."""
    values = torch.empty(*words.shape, 8)
    for j, asm in enumerate((UNPACK_0, UNPACK_1, UNPACK_2, UNPACK_3)):
        pair = _run_ptx(asm.value, words, multiplier)
        if then is not None:
            pair = _bf16x2_product(pair, then)
        values[..., j] = _bf16_bits_to_float(pair & 0xFFFF)
        values[..., j + 4] = _bf16_bits_to_float(pair >> 16)
    return values.flatten(-2)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] → the little-endian 32-bit words [..., n] as int64."""
    return codes.contiguous().view(torch.int32).to(torch.int64) & _MASK


def _same_bits(ours: torch.Tensor, reference: torch.Tensor) -> bool:
    return torch.equal(ours.view(torch.int32), reference.float().view(torch.int32))


def test_expert_unpack_is_the_mxfp4_codec_for_scales_up_to_128() -> None:
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (129, 64), dtype=torch.uint8, generator=generator)
    codes[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) + torch.arange(8)  # all nibbles
    scales = torch.arange(129, dtype=torch.uint8)[:, None].expand(129, 4)  # codes 0 .. 128
    multiplier = ((scales.to(torch.int64) + 126) << 7).repeat_interleave(4, dim=1)
    ours = _unpacked(_words(codes), multiplier | (multiplier << 16))
    assert _same_bits(ours, mxfp4_to_float(codes.view(torch.int8), scales))


def test_attention_row_unpack_is_the_fp4_row_codec_for_every_scale() -> None:
    """Every e4m3 scale byte but NaN, every code: e2m1 · 2^-8 from the prescale, times the
    scale · 2^8 in bf16, is the row codec's value bit for bit (signed zeros included)."""
    dim = 512
    generator = torch.Generator().manual_seed(1)
    scale_bytes = torch.arange(256, dtype=torch.uint8)
    scale_bytes = scale_bytes[(scale_bytes & 0x7F) != 0x7F]  # e4m3 NaN is never written
    rows = scale_bytes.numel()
    codes = torch.randint(0, 256, (rows, dim // 2), dtype=torch.uint8, generator=generator)
    scales = scale_bytes[:, None].expand(rows, dim // 16)
    packed = torch.cat([codes, scales], dim=1)
    # the kernel's scale pair: e4m3 · 2^8 in bf16 (exact), in both halves, one per two words
    scale = (e4m3_to_float(scales) * 256.0).to(torch.bfloat16)
    scale_bits = scale.view(torch.int16).to(torch.int64) & 0xFFFF
    pairs = (scale_bits | (scale_bits << 16)).repeat_interleave(2, dim=1)
    words = _words(codes)
    prescale = torch.full_like(words, int(_UNPACK_PRESCALE.value))
    assert _same_bits(_unpacked(words, prescale, then=pairs), fp4_rows_to_float(packed))


def test_a_pool_reads_as_words_only_on_four_byte_boundaries() -> None:
    """The kernels read FP4 rows as 32-bit words only where the pool's start and strides allow
    it (`reads_as_words`); a pool of the released row width (288 bytes) does, the same rows cut
    from wider or offset storage do not."""
    pool = torch.zeros(3, 64, 288, dtype=torch.uint8)
    assert reads_as_words(pool)
    wide = torch.zeros(3, 64, 289, dtype=torch.uint8)
    assert not reads_as_words(wide[..., :288])  # row stride 289
    offset = torch.zeros(3 * 64 * 288 + 1, dtype=torch.uint8)[1:].view(3, 64, 288)
    assert not reads_as_words(offset)  # start one byte in
