"""Every kernel's launch shape is a pure function of shapes (a table), never tuned at run time:
an autotuner benchmarks each new key on first use, which under serving stalls every stream
(issue 17: 14 % of the H200 engine thread in `Autotuner._bench`)."""

from __future__ import annotations

import importlib
import pkgutil

from triton.runtime.autotuner import Autotuner, Heuristics

import kernels
from kernels import grouped_mxfp4_gemm


def test_no_kernel_is_autotuned() -> None:
    tuned = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        tuned += [
            f"{info.name}.{name}"
            for name, value in vars(module).items()
            if isinstance(value, Autotuner | Heuristics)
        ]
    assert tuned == []


def test_the_grouped_gemm_tables_give_tiles_for_every_block_size_and_use() -> None:
    # the released expert shapes (gate/up 5120 -> 2 x 2304, down 2304 -> 5120) and `default`'s
    for n, k in ((2304, 5120), (5120, 2304), (128, 256), (256, 128)):
        for gated in (True, False):
            for block_m in (16, 32):
                tiles = grouped_mxfp4_gemm.decode_tiles(n, k, block_m, gated)
                assert {"BLOCK_N", "PREFETCH", "num_warps", "num_stages"} <= set(tiles)
            for block_m in (64, 128):
                tiles = grouped_mxfp4_gemm.prefill_tiles(n, k, block_m, gated)
                assert k % tiles["BLOCK_K"] == 0 and tiles["BLOCK_N"] >= 16
