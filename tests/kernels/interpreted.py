"""Kernel test helpers.

`run_interpreted` runs a snippet under Triton's CPU interpreter (`TRITON_INTERPRET=1` must be set
before Triton compiles anything, hence a fresh process). The kernels' own code runs there, fp32
dots included (its bf16 `tl.dot` is not trustworthy), so their logic is tested without a GPU.
The interpreter's `tl.dot` is numpy's matmul; OpenBLAS's AVX2 kernels round a row differently
by its place in the block (the AVX-512 ones do not), so a test of row invariance asks for
`rows_alone`: each row of a dot is then multiplied on its own, as the GPU's MMA does.
`ulps` measures a kernel's distance to its reference in units of the last place; `same_bits`
asks for none (bit for bit, any NaN equal to any NaN).
`tensor_core_gemms` gives the CPU torch the fp32-output bf16 GEMM that only CUDA's has.
`compile_for_hopper` compiles a kernel for sm90 without a GPU (what the interpreter cannot show);
`sum_of_squares_ops` reads a row norm's reduction from that PTX.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).parents[2]


_ROWS_ALONE = """
import numpy
_blocked_matmul = numpy.matmul
def _rows_alone(a, b, **kwargs):
    if a.ndim != 2:
        return _blocked_matmul(a, b, **kwargs)
    rows = [_blocked_matmul(row[None], b, **kwargs) for row in a]
    return numpy.concatenate(rows) if rows else _blocked_matmul(a, b, **kwargs)
numpy.matmul = _rows_alone
"""


_TENSOR_CORE_GEMMS = """
from benchmarks.kernel_census import provide_bf16_gemms_to_fp32_on_cpu
_tensor_core_gemms = provide_bf16_gemms_to_fp32_on_cpu()
"""


def run_interpreted(
    code: str, timeout_s: float = 600, rows_alone: bool = False, tensor_core_gemms: bool = False
) -> Any:
    """Run `code` (which prints one JSON value last) in the interpreter; return that value.

    `rows_alone`: multiply each row of the interpreter's dots on its own (see the module note).
    `tensor_core_gemms`: provide the bf16 GEMMs with fp32 output that only CUDA's torch has,
    as the kernel census does, so that the fp32 products of bf16 weights take their
    tensor-core branch (`dense.fp32_on_tensor_cores`: the split and sum kernels).
    """
    prefix = (_ROWS_ALONE if rows_alone else "") + (_TENSOR_CORE_GEMMS if tensor_core_gemms else "")
    result = subprocess.run(
        [sys.executable, "-c", prefix + code],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def ulps(ours: torch.Tensor, reference: torch.Tensor, terms: torch.Tensor | None = None) -> float:
    """Largest difference in units of the reference's last place (0 for empty tensors).

    For a sum that cancels, pass `terms` (Σ |term| per element): the unit is then the last
    place of |reference| + terms, the scale at which a fused multiply-add or another summation
    order rounds (the CUDA compiler fuses, the interpreter does not).
    """
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    if not reference.numel():
        return 0.0
    scale = reference.float().abs()
    if terms is not None:
        scale = scale + terms.float()
    spacing = torch.finfo(reference.dtype).eps * scale.clamp(min=1e-30)
    return float(((ours.float() - reference.float()).abs() / spacing).max())


def same_bits(ours: torch.Tensor, reference: torch.Tensor) -> bool:
    """Same shape, dtype and bits everywhere (±0 told apart), except that NaNs match NaNs (their
    payloads differ by device)."""
    if ours.shape != reference.shape or ours.dtype != reference.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[ours.element_size()]
    same = ours.view(as_int) == reference.view(as_int)
    return bool((same | (ours.isnan() & reference.isnan())).all())


def compile_for_hopper(
    kernel, types: dict[str, str], constexprs: dict, aligned: set[str], options: dict | None = None
) -> str:
    """PTX of `kernel` compiled for sm90 (Triton's bundled ptxas), with the 16-divisibility
    that a launch on aligned tensors and widths gets; every argument is typed in `types` or
    given in `constexprs`; `options`: further compile options, as a launch passes them. A
    Gluon kernel compiles as one (its layouts are its own)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    names = kernel.arg_names
    signature = {name: types.get(name, "constexpr") for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in aligned}
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "num_stages": 4, **(options or {})},
    )
    return compiled.asm["ptx"]


def sum_of_squares_ops(ptx: str, elements_per_thread: int) -> collections.Counter:
    """The adds and shuffles from a row's first square to its rsqrt in `ptx`, after checking
    that every square is an explicit fused multiply-add onto +0 (`rms_norm.inv_rms`: no
    multiply left to contract into the sum's adds). Two kernels whose counts agree reduce a
    row alike."""
    square = r"fma\.rn\.f32\s+%r\d+, (%r\d+), \1, 0f00000000;"
    assert len(re.findall(square, ptx)) == elements_per_thread
    start = re.search(square, ptx).start()
    body = ptx[start : ptx.index("rsqrt", start)].split()
    return collections.Counter(op for op in body if op in ("add.f32", "shfl.sync.bfly.b32"))
