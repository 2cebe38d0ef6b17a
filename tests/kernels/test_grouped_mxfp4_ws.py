"""The warp-specialized kernel of the grouped MXFP4 GEMM (`kernels.grouped_mxfp4_ws`): bit for
bit the cp.async Gluon kernel's products and within the torch reference's tolerance on a Hopper
GPU at prefill's and decode's block sizes, refused where its contract does not hold, and
compiled for sm90 here."""

from __future__ import annotations

import re

import pytest
import torch

from kernels import grouped_mxfp4_gemm as grouped
from kernels import grouped_mxfp4_gluon as gluon_decode
from kernels import grouped_mxfp4_ws as ws
from kernels.grouped_mxfp4_gemm import align_to_experts, grouped_mxfp4_gemm_reference
from tests.kernels.interpreted import compile_for_hopper, run_interpreted
from tests.kernels.test_grouped_mxfp4_gemm import _relative_error, _routing, decode_expert_weights
from tests.kernels.test_grouped_mxfp4_gluon import _tiles_id

needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the warp-specialized kernel runs on sm90",
)

_SHAPES = (  # (tokens, dim, inter, block_m)
    (600, 5120, 2304, 128),  # the released widths
    (700, 1024, 384, 128),  # the down's 3 steps of K: odd, and fewer than 4 ring slots
    (300, 256, 128, 128),  # one step of the down's K, one column tile of the gate/up
    (16, 5120, 2304, 16),  # decode at the released widths
    (256, 5120, 2304, 32),
    (200, 1024, 384, 64),
    (5, 384, 256, 16),  # K of 3 and 2 steps
)
_CASES = [
    pytest.param(tiles, shape, id=f"{_tiles_id(tiles)}-{'-'.join(map(str, shape))}")
    for shape in _SHAPES
    for tiles in (ws.PREFILL_CANDIDATES if shape[3] == 128 else ws.DECODE_CANDIDATES)
]


def _prefill_case(num_tokens: int, dim: int, inter: int, block_m: int, seed: int):
    device, num_experts, top_k = "cuda", 8, 6
    torch.manual_seed(seed)
    x = torch.randn(num_tokens, dim, device=device).bfloat16()
    routing = _routing(num_tokens, num_experts, top_k, seed=seed, device=device)
    blocks = align_to_experts(routing, num_experts, block_m)
    return x, blocks, decode_expert_weights(num_experts, dim, inter, device)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("tiles", "shape"), _CASES)
def test_every_candidate_gives_the_cp_async_kernels_bits(tiles: dict, shape: tuple) -> None:
    """Gate/up (x gathered into position order, output in the kernel's K order, as the
    launcher chains them) and down (routing weights multiplied in): the same products in the
    same order as `grouped_mxfp4_gluon`'s, so the same bits, and the reference's values."""
    num_tokens, dim, inter, block_m = shape
    x, blocks, (w13, s13, w2, s2) = _prefill_case(num_tokens, dim, inter, block_m, num_tokens)
    cp_async = {"num_warps": tiles["num_warps"]}
    used = blocks.pair_of_pos >= 0
    x_ordered = grouped._in_kernel_order(x)
    acts = []
    for launch in ("ws", "cp.async"):
        act = torch.full((blocks.num_positions, inter), float("nan"), device="cuda").bfloat16()
        if launch == "ws":
            ws.launch(grouped.rows_at_positions(x, blocks), blocks, (w13, s13), act, 7.0, None,
                      out_kernel_order=True, **tiles)  # fmt: skip
        else:
            gluon_decode.launch_decode(x_ordered, blocks, (w13, s13), act, 7.0, None,
                                       out_kernel_order=True, **cp_async)  # fmt: skip
        acts.append(act)
    assert torch.equal(acts[0][used], acts[1][used])
    act_plain = grouped_mxfp4_gemm_reference(x, blocks, w13, s13, gate_limit=7.0)
    assert _relative_error(acts[0][used], grouped._in_kernel_order(act_plain)[used]) < 1e-2
    act_plain[~used] = 0
    pair_weight = torch.rand(blocks.num_pairs, device="cuda")
    act_in = grouped._in_kernel_order(act_plain)
    outs = []
    for launch in ("ws", "cp.async"):
        out = torch.full((blocks.num_pairs, dim), float("nan"), device="cuda")
        if launch == "ws":
            ws.launch(act_in, blocks, (w2, s2), out, None, pair_weight, **tiles)
        else:
            gluon_decode.launch_decode(act_in, blocks, (w2, s2), out, None, pair_weight,
                                       **cp_async)  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])  # every pair's row written: no NaN compares equal
    out_ref = grouped_mxfp4_gemm_reference(
        act_plain, blocks, w2, s2, row_weight=pair_weight, out_dtype=torch.float32
    )
    assert _relative_error(outs[0], out_ref) < 1e-3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_launcher_choice_gives_the_cp_async_kernels_bits(block_m: int, monkeypatch) -> None:
    """`"gluon-ws"` as `PREFILL_KERNEL` (blocks of 128) and `DECODE_KERNEL` (blocks of 16 and
    32): the launcher's gate/up (written in the kernel's K order) then down give the bits of
    the `"gluon"` choice."""
    x, blocks, (w13, s13, w2, s2) = _prefill_case(700 if block_m == 128 else 200, 1024, 384,
                                                  block_m, seed=3)  # fmt: skip
    results = []
    for choice in ("gluon-ws", "gluon"):
        monkeypatch.setattr(grouped, "PREFILL_KERNEL", choice)
        monkeypatch.setattr(grouped, "DECODE_KERNEL", choice)
        act = grouped.grouped_mxfp4_gemm(x, blocks, w13, s13, gate_limit=7.0,
                                         out_kernel_order=True, register_unpack=True)  # fmt: skip
        act[blocks.pair_of_pos < 0] = 0
        out = grouped.grouped_mxfp4_gemm(act, blocks, w2, s2, out_dtype=torch.float32,
                                         x_kernel_order=True, register_unpack=True)  # fmt: skip
        results.append(out)
    assert torch.equal(results[0], results[1])


def test_contract_refused_off_hopper_and_off_its_shapes() -> None:
    """Here (no sm90 GPU) the kernel never takes a launch, and asked for directly it says so
    with a clear error instead of running in some other form."""
    blocks = align_to_experts(torch.zeros(4, 2, dtype=torch.long), 4, 128)
    x = torch.zeros(blocks.num_positions, 256, dtype=torch.bfloat16)
    codes = torch.zeros(4, 256, 128, dtype=torch.int8)
    scales = torch.zeros(4, 256, 8, dtype=torch.uint8)
    out = torch.empty(blocks.num_positions, 128, dtype=torch.bfloat16)
    assert not ws.runs(x, blocks, codes, 128)
    with pytest.raises(ValueError, match="not this kernel"):
        ws.launch(x, blocks, (codes, scales), out, 7.0, None)


def test_rows_at_positions_matches_its_reference_in_the_interpreter() -> None:
    """One launch gathers each position's token row (padding positions: row 0) in the kernel's
    K order, or as it is: the torch reference's rows bit for bit, at K of 384 (a tail under
    the launch's 1,024 columns) and 2,304."""
    result = run_interpreted(_ROWS_AT_POSITIONS)
    assert result == [True, True, True, True]


_ROWS_AT_POSITIONS = """
import json, torch
from kernels import grouped_mxfp4_gemm as grouped
routing = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1], [1, 0]])
blocks = grouped.align_to_experts(routing, 3, 16)
same = []
for k in (384, 2304):
    x = torch.randn(5, k).bfloat16()
    for order in (True, False):
        ours = grouped.rows_at_positions(x, blocks, kernel_order=order)
        same.append(torch.equal(ours, grouped.rows_at_positions_reference(x, blocks, order)))
print(json.dumps(same))
"""


@pytest.mark.slow
@pytest.mark.skipif(not ws.AVAILABLE, reason="this Triton has no warp-specialized Gluon")
@pytest.mark.parametrize(
    ("gated", "block_m"),
    [(True, 128), (False, 128), (True, 16), (False, 32)],
    ids=["gate_up-prefill", "down-prefill", "gate_up-16", "down-32"],
)
def test_compiled_kernel_loads_by_tma_in_one_producer_warp(gated: bool, block_m: int) -> None:
    """Compiled for sm90 here at the released widths and the launch table's options: the ring
    is filled by TMA copies only (the words of one or two matrices and the x tile as two
    128-byte-swizzled boxes), the producer gives its registers to the consumers (240 at
    prefill, 136 at decode: no spill), and the products are the cp.async kernel's
    (`m64n{rows}k16`, waited for with one in flight)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    k = 5120 if gated else 2304
    options = ws.tiles(block_m, gated)
    words = torch.zeros(1024, k // 8, dtype=torch.int32)
    x = torch.zeros(1024, k, dtype=torch.bfloat16)
    words_shared = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    x_shared = gl.NVMMASharedLayout.get_default_for([block_m, ws.STEP_K], gl.bfloat16)
    block_n = 16 * options["num_warps"]
    types = {
        "x_desc": mangle_type(TensorDescriptor.from_tensor(x, [block_m, ws.STEP_K], x_shared)),
        "codes_desc": mangle_type(
            TensorDescriptor.from_tensor(words, [block_n, ws.STEP_K // 8], words_shared)
        ),
        "scales_ptr": "*u8", "out_ptr": "*bf16" if gated else "*fp32", "pair_of_pos_ptr": "*i32",
        "block_expert_ptr": "*i32", "row_weight_ptr": "*fp32", "gate_limit": "fp32",
        **dict.fromkeys(("N", "K", "num_blocks", "stride_sn", "stride_se", "stride_om"), "i32"),
    }  # fmt: skip
    constexprs = {"GATED": gated, "HAS_ROW_WEIGHT": not gated, "STORE_KERNEL_ORDER": gated,
                  "STAGES": options["stages"], "GROUP_BLOCKS": options["group_blocks"]}  # fmt: skip
    pointers = {name for name, kind in types.items() if kind.startswith("*")}
    launch = {"num_warps": options["num_warps"], "maxnreg": options["max_registers"]}
    ptx = compile_for_hopper(ws._ws_kernel, types, constexprs, pointers, launch)
    copies = re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)
    assert len(copies) == (2 if gated else 1) + 2
    assert "cp.async.cg" not in ptx and "cp.async.ca" not in ptx
    consumers = 240 if block_m == 128 else 136
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{consumers}", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24", ptx)
    assert "st.local" not in ptx
    assert re.search(r"wgmma\.wait_group\.sync\.aligned 1;", ptx)
    products = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_m}k16", ptx)
    assert len(products) == 8 * (2 if gated else 3)
