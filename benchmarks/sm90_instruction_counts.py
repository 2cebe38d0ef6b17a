"""SASS instructions per main-loop iteration of the decode expert GEMM, compiled for sm90 on
this machine (Triton's bundled ptxas and cuobjdump; no GPU): the Triton `_decode_kernel` and
the Gluon one the product takes on Hopper (`kernels.grouped_mxfp4_gluon`; its down loop holds
two K steps) at their tuned tiles, and an FP8-operand variant that exists only here, to ask
whether FP8 activations would take the kernel off its instruction-issue bound
(`docs/performance.md`, 2026-12-07).

The product's unpack turns each e2m1 code into bf16 (shifts and masks, one bf16x2 multiply by
the block scale per two values: ~5 instructions per register of two). The variant keeps the
codes' magnitude and sign bits in place as e4m3 (`_E4M3_EVEN`, `_E4M3_ODD`: e2m1 · 2^-6, exact,
~5 instructions per eight values), takes x as e4m3 with one power-of-two scale per 128 columns,
and runs one FP8 wgmma (m64nNk32) per 32-column scale block into a fresh fp32 tile that one
fused multiply-add per element scales into the accumulator. Its numerics differ from the
product's (x rounded to e4m3); it is a measurement, not a path of the model.

    python3 benchmarks/sm90_instruction_counts.py

prints, per kernel and tile: registers, spill stores, the loop's instruction count, the values
of W each thread unpacks per iteration, and the loop's instructions by opcode family.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from kernels import grouped_mxfp4_gemm as gemm
from kernels import grouped_mxfp4_gluon as gluon_gemm

_E4M3_EVEN = tl.constexpr(
    "{ .reg .b32 t, m; shl.b32 m, $1, 2; shl.b32 t, $1, 4; and.b32 m, m, 0x1C1C1C1C; "
    "lop3.b32 $0, m, t, 0x80808080, 0xF8; }"
)
_E4M3_ODD = tl.constexpr(
    "{ .reg .b32 m; shr.b32 m, $1, 2; and.b32 m, m, 0x1C1C1C1C; "
    "lop3.b32 $0, m, $1, 0x80808080, 0xF8; }"
)


@triton.jit
def _e4m3_operand(codes, BLOCK_N: tl.constexpr):
    """e4m3 [BLOCK_N, 32] (value · 2^-6) of one scale block's 16 code bytes per row, in the
    K order [h, q, j] that puts lane quad q's word where the m64nNk32 A operand wants it."""
    even = tl.inline_asm_elementwise(_E4M3_EVEN, "=r,r", [codes], tl.uint8, is_pure=True, pack=4)
    odd = tl.inline_asm_elementwise(_E4M3_ODD, "=r,r", [codes], tl.uint8, is_pure=True, pack=4)
    w = tl.permute(tl.reshape(tl.join(even, odd), (BLOCK_N, 4, 4, 2)), (0, 3, 1, 2))
    return tl.reshape(w, (BLOCK_N, 32)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _block_scale(scale_word, i: tl.constexpr):
    return ((((scale_word >> (8 * i)) & 0xFF) + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_step(codes_ptr, scales_ptr, rows, k0, stride_cn, stride_sn, x0, x1, x2, x3,
              BLOCK_N: tl.constexpr):  # fmt: skip
    codes = tl.load(codes_ptr + rows[:, None] * stride_cn + k0 // 2 + tl.arange(0, 64)[None, :])
    codes = gemm._operand_rows(codes, BLOCK_N, 64)
    codes = tl.permute(tl.reshape(codes, (BLOCK_N, 4, 4, 4)), (0, 1, 3, 2))
    c01, c23 = tl.split(tl.reshape(codes, (BLOCK_N, 16, 2, 2)))
    c0, c1 = tl.split(c01)
    c2, c3 = tl.split(c23)
    scale_word = tl.load((scales_ptr + rows * stride_sn + k0 // 32).to(tl.pointer_type(tl.uint32)))
    scale_word = gemm._operand_rows(tl.reshape(scale_word, (BLOCK_N, 1)), BLOCK_N, 1)
    scale_word = tl.reshape(scale_word, (BLOCK_N,))
    t = tl.dot(_e4m3_operand(c0, BLOCK_N), x0) * _block_scale(scale_word, 0)[:, None]
    t += tl.dot(_e4m3_operand(c1, BLOCK_N), x1) * _block_scale(scale_word, 1)[:, None]
    t += tl.dot(_e4m3_operand(c2, BLOCK_N), x2) * _block_scale(scale_word, 2)[:, None]
    t += tl.dot(_e4m3_operand(c3, BLOCK_N), x3) * _block_scale(scale_word, 3)[:, None]
    return t


@triton.jit
def _fp8_operand_kernel(x_ptr, x_scales_ptr, codes_ptr, scales_ptr, out_ptr, N, K, stride_cn,
                        stride_sn, stride_xm, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr):  # fmt: skip
    """Gate/up of one expert's token block (the variant; no routing, no tails)."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(0, K, 128):
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + k0 + tl.arange(0, 32)[:, None]
        x0, x1 = tl.load(x_ptrs), tl.load(x_ptrs + 32)
        x2, x3 = tl.load(x_ptrs + 64), tl.load(x_ptrs + 96)
        x_scale = tl.load(x_scales_ptr + offs_m * (K // 128) + k0 // 128).to(tl.int32)
        x_scale = (x_scale << 23).to(tl.float32, bitcast=True)[None, :]
        acc += _fp8_step(codes_ptr, scales_ptr, offs_n, k0, stride_cn, stride_sn, x0, x1, x2, x3,
                         BLOCK_N) * x_scale  # fmt: skip
        acc_up += _fp8_step(codes_ptr, scales_ptr, offs_n + N, k0, stride_cn, stride_sn, x0, x1,
                            x2, x3, BLOCK_N) * x_scale  # fmt: skip
    acc = acc * tl.sigmoid(acc) * acc_up
    tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(tl.bfloat16))


_DECODE_TYPES = {
    "x_ptr": "*bf16", "codes_ptr": "*i32", "scales_ptr": "*u8", "out_ptr": "*bf16",
    "pair_of_pos_ptr": "*i32", "block_expert_ptr": "*i32", "row_weight_ptr": "*fp32",
    "N": "i32", "K": "i32", "gate_limit": "fp32", "stride_xm": "i32", "stride_ce": "i32",
    "stride_cn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_om": "i32",
}  # fmt: skip
_FP8_TYPES = {
    "x_ptr": "*fp8e4nv", "x_scales_ptr": "*u8", "codes_ptr": "*u8", "scales_ptr": "*u8",
    "out_ptr": "*bf16", "N": "i32", "K": "i32", "stride_cn": "i32", "stride_sn": "i32",
    "stride_xm": "i32",
}  # fmt: skip


def _compile(kernel, types: dict[str, str], constexprs: dict, options: dict):
    names = kernel.arg_names
    signature = {name: types.get(name, "constexpr") for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name in types and name != "gate_limit"}  # fmt: skip
    source_type = ASTSource
    if kernel.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    source = source_type(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([str(tool), flag, path], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def _registers(cubin: bytes) -> int:
    return int(re.search(r"REG:(\d+)", _cuobjdump(cubin, "--dump-resource-usage"))[1])


# "/*0410*/  @!P0 BRA 0xea0 ;": address, (predicate), opcode, operands
_INSTRUCTION = re.compile(
    r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*)"
)


def loop_profile(sass: str) -> tuple[list[str], int]:
    """The opcodes of the main loop (the body of the longest backward branch) and the count of
    local-memory stores (spills) in the whole kernel."""
    ops = [(int(m[1], 16), m[2], m[3]) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    spills = sum(op.startswith("STL") for _, op, _ in ops)
    loops = []
    for address, op, operands in ops:
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target[1], 16) < address:
            loops.append((int(target[1], 16), address))
    if not loops:
        return [], spills
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [op for address, op, _ in ops if start <= address <= end], spills


def _row(label: str, compiled, values_per_thread: int) -> str:
    cubin = compiled.asm["cubin"]
    body, spills = loop_profile(_cuobjdump(cubin, "-sass"))
    families = collections.Counter(op.split(".")[0] for op in body).most_common(10)
    per_value = len(body) / values_per_thread
    return (f"| {label} | {_registers(cubin)} | {spills} | {len(body)} | "
            f"{values_per_thread} | {per_value:.2f} | "
            + ", ".join(f"{name} {count}" for name, count in families) + " |")  # fmt: skip


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(
        "| kernel, tile | registers | spill stores | loop instructions | W values per thread"
        " per iteration | instructions per value | by opcode |"
    )
    print("|---|---|---|---|---|---|---|")
    for block_m in (16, 32):
        for gated in (True, False):
            n, k = (2304, 5120) if gated else (5120, 2304)  # the released layer's widths
            tiles = gemm.decode_tiles(n, k, block_m, gated)
            constexprs = {"TOP_K": 6, "GATED": gated, "TOKEN_ROWS": gated,
                          "HAS_ROW_WEIGHT": False, "EVEN_K": True, "BLOCK_M": block_m,
                          "STORE_KERNEL_ORDER": gated}  # fmt: skip
            constexprs |= {key: tiles[key] for key in ("BLOCK_N", "PREFETCH")}
            options = {key: tiles[key] for key in ("num_warps", "num_stages", "maxnreg")}
            types = dict(_DECODE_TYPES, out_ptr="*bf16" if gated else "*fp32")
            compiled = _compile(gemm._decode_kernel, types, constexprs, options)
            values = tiles["BLOCK_N"] * 128 * (2 if gated else 1) // (32 * tiles["num_warps"])
            use = "gate/up" if gated else "down"
            label = f"`_decode_kernel` {use}, blocks of {block_m}, {tiles['BLOCK_N']} rows"
            print(_row(label, compiled, values))
    for block_m in (16, 32) if gluon_gemm.AVAILABLE else ():
        for gated in (True, False):
            n, k = (2304, 5120) if gated else (5120, 2304)
            tiles = gluon_gemm.decode_tiles(n, k, block_m, gated)
            constexprs = {"TOP_K": 6, "GATED": gated, "TOKEN_ROWS": gated,
                          "HAS_ROW_WEIGHT": False, "BLOCK_M": block_m,
                          "STAGES": tiles["stages"], "STORE_KERNEL_ORDER": gated,
                          "EARLY_UP_WORDS": tiles.get("early_up_words", False),
                          "GROUP_BLOCKS": tiles.get("group_blocks", 0)}  # fmt: skip
            types = dict(_DECODE_TYPES, out_ptr="*bf16" if gated else "*fp32", num_blocks="i32")
            compiled = _compile(gluon_gemm._decode_kernel, types, constexprs,
                                {"num_warps": tiles["num_warps"]})  # fmt: skip
            values = 128  # gate and up of one step, or two steps of the down, per thread
            use = "gate/up" if gated else "down (two steps)"
            rows = 16 * tiles["num_warps"]
            label = f"Gluon `_decode_kernel` {use}, blocks of {block_m}, {rows} rows"
            print(_row(label, compiled, values))
    for block_n, block_m in ((64, 16), (64, 32), (128, 32)):
        warps = block_n // 16
        options = {"num_warps": warps, "num_stages": 1, "maxnreg": 128}
        compiled = _compile(_fp8_operand_kernel, _FP8_TYPES,
                            {"BLOCK_N": block_n, "BLOCK_M": block_m}, options)  # fmt: skip
        values = block_n * 128 * 2 // (32 * warps)
        label = f"FP8-operand variant gate/up, blocks of {block_m}, {block_n} rows"
        print(_row(label, compiled, values))


if __name__ == "__main__":
    main()
