"""The Gluon decode kernel of the grouped MXFP4 GEMM (`kernels.grouped_mxfp4_gluon`): against
the torch reference and the Triton decode kernel on a Hopper GPU, and compiled for sm90 here."""

from __future__ import annotations

import re

import pytest
import torch

from kernels import grouped_mxfp4_gemm as grouped
from kernels import grouped_mxfp4_gluon as gluon_decode
from kernels.grouped_mxfp4_gemm import align_to_experts, grouped_mxfp4_gemm_reference
from tests.kernels.interpreted import compile_for_hopper
from tests.kernels.test_grouped_mxfp4_gemm import _relative_error, _routing, decode_expert_weights

needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the Gluon decode kernel runs on sm90",
)


def _tiles_id(tiles: dict) -> str:
    early = "-early" if tiles.get("early_up_words") else ""
    group = f"-g{tiles['group_blocks']}" if tiles.get("group_blocks") else ""
    cap = f"-r{tiles['max_registers']}" if tiles.get("max_registers") else ""
    return f"w{tiles['num_warps']}-s{tiles['stages']}{early}{group}{cap}"


_DECODE_SHAPES = (  # (tokens, dim, inter, block_m)
    (16, 5120, 2304, 16),  # the released widths
    (256, 5120, 2304, 32),
    (256, 5120, 2304, 64),  # one block per expert (the launcher's table stops at 32)
    (200, 1024, 384, 32),  # N tails of 64 and 128 weight rows; 3 steps of K
    (5, 384, 256, 16),  # K of 3 and 2 steps: fewer than the ring's slots
)
_CASES = [
    pytest.param(tiles, shape, id=f"{_tiles_id(tiles)}-{'-'.join(map(str, shape))}")
    for shape in _DECODE_SHAPES
    for tiles in gluon_decode.CANDIDATES
] + [  # blocks of 128 rows, a prefill chunk's, at the released widths
    pytest.param(tiles, (600, 5120, 2304, 128), id=f"{_tiles_id(tiles)}-prefill")
    for tiles in gluon_decode.PREFILL_CANDIDATES
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("tiles", "shape"), _CASES)
def test_every_candidate_matches_the_reference_and_the_triton_kernel(
    tiles: dict, shape: tuple
) -> None:
    num_tokens, dim, inter, block_m = shape
    device, num_experts, top_k = "cuda", 8, 6
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, dim, device=device).bfloat16()
    blocks = align_to_experts(
        _routing(num_tokens, num_experts, top_k, seed=num_tokens, device=device),
        num_experts,
        block_m,
    )
    w13, s13, w2, s2 = decode_expert_weights(num_experts, dim, inter, device)
    used = blocks.pair_of_pos >= 0
    act = torch.zeros(blocks.num_positions, inter, dtype=torch.bfloat16, device=device)
    gluon_decode.launch_decode(
        grouped._in_kernel_order(x), blocks, (w13, s13), act, 7.0, None, **tiles
    )
    act_ref = grouped_mxfp4_gemm_reference(x, blocks, w13, s13, gate_limit=7.0)
    assert _relative_error(act[used], act_ref[used]) < 1e-2
    triton_act = grouped_mxfp4_gemm(x, blocks, w13, s13, gate_limit=7.0)
    assert _relative_error(act[used], triton_act[used]) < 1e-2
    act_ref[~used] = 0
    pair_weight = torch.rand(blocks.num_pairs, device=device)
    out = torch.full((blocks.num_pairs, dim), float("nan"), device=device)
    gluon_decode.launch_decode(
        grouped._in_kernel_order(act_ref), blocks, (w2, s2), out, None, pair_weight, **tiles
    )
    out_ref = grouped_mxfp4_gemm_reference(
        act_ref, blocks, w2, s2, row_weight=pair_weight, out_dtype=torch.float32
    )
    assert _relative_error(out, out_ref) < 1e-3  # every pair's row written (no NaN left)


def grouped_mxfp4_gemm(x, blocks, codes, scales, **kwargs):
    """The launcher with the Triton decode kernel, whatever `DECODE_KERNEL` says."""
    choice = grouped.DECODE_KERNEL
    grouped.DECODE_KERNEL = "triton"
    try:
        return grouped.grouped_mxfp4_gemm(x, blocks, codes, scales, **kwargs)
    finally:
        grouped.DECODE_KERNEL = choice


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_launcher_choice_with_kernel_order_between_gate_up_and_down(
    block_m: int, monkeypatch
) -> None:
    """The launcher taking the Gluon kernel (gate/up written in the kernel's K order, down
    reading it as it is) gives the plain order's bits, and the reference's values; blocks of
    128 rows (prefill) where the caller vouches for the unpack."""
    monkeypatch.setattr(grouped, "DECODE_KERNEL", "gluon")
    monkeypatch.setattr(grouped, "PREFILL_KERNEL", "gluon")
    device, num_experts, top_k, dim, inter = "cuda", 8, 6, 1024, 384
    num_tokens = 700 if block_m == 128 else 200
    exact = {"register_unpack": True}
    torch.manual_seed(block_m)
    x = torch.randn(num_tokens, dim, device=device).bfloat16()
    blocks = align_to_experts(
        _routing(num_tokens, num_experts, top_k, seed=5, device=device), num_experts, block_m
    )
    w13, s13, w2, s2 = decode_expert_weights(num_experts, dim, inter, device)
    results = []
    assert grouped.reads_kernel_order(inter, block_m, exact_unpack=True, x=x)
    for order in (False, True):
        act = grouped.grouped_mxfp4_gemm(
            x, blocks, w13, s13, gate_limit=7.0, out_kernel_order=order, **exact
        )
        act[blocks.pair_of_pos < 0] = 0
        results.append(
            grouped.grouped_mxfp4_gemm(
                act, blocks, w2, s2, out_dtype=torch.float32, x_kernel_order=order, **exact
            )
        )
    assert torch.equal(results[0], results[1])
    act_ref = grouped_mxfp4_gemm_reference(x, blocks, w13, s13, gate_limit=7.0)
    act_ref[blocks.pair_of_pos < 0] = 0
    out_ref = grouped_mxfp4_gemm_reference(act_ref, blocks, w2, s2, out_dtype=torch.float32)
    assert _relative_error(results[0], out_ref) < 1e-2


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("group_blocks", [1, 3, 8, 64])
def test_grouped_program_order_gives_the_same_bits(group_blocks: int) -> None:
    """`group_blocks` only reorders the programs: every (block, column tile) is computed once,
    the same way, also where the last group is short or one group holds every block."""
    device, num_experts, top_k, dim, inter, num_tokens = "cuda", 8, 6, 1024, 384, 700
    torch.manual_seed(group_blocks)
    x = torch.randn(num_tokens, dim, device=device).bfloat16()
    blocks = align_to_experts(
        _routing(num_tokens, num_experts, top_k, seed=7, device=device), num_experts, 128
    )
    w13, s13, _, _ = decode_expert_weights(num_experts, dim, inter, device)
    x = grouped._in_kernel_order(x)
    outs = []
    for group in (0, group_blocks):
        out = torch.full((blocks.num_positions, inter), float("nan"), device=device)
        gluon_decode.launch_decode(x, blocks, (w13, s13), out, 7.0, None, num_warps=8,
                                   group_blocks=group)  # fmt: skip
        outs.append(out[blocks.pair_of_pos >= 0])
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@needs_hopper
def test_launcher_gives_prefill_blocks_to_gluon_only_with_exact_scales(monkeypatch) -> None:
    """Blocks of 128 rows go to the Gluon kernel where `PREFILL_KERNEL` says so and the caller
    vouches for its unpack (`register_unpack`), and the result is the reference's; without
    that promise the Triton prefill kernel runs (weights with scale codes above 128 stay
    exact)."""
    monkeypatch.setattr(grouped, "PREFILL_KERNEL", "gluon")
    device, num_experts, top_k, dim, inter, num_tokens = "cuda", 8, 6, 1024, 384, 700
    torch.manual_seed(128)
    x = torch.randn(num_tokens, dim, device=device).bfloat16()
    blocks = align_to_experts(
        _routing(num_tokens, num_experts, top_k, seed=7, device=device), num_experts, 128
    )
    w13, s13, w2, s2 = decode_expert_weights(num_experts, dim, inter, device)
    pair_weight = torch.rand(blocks.num_pairs, device=device)
    act = grouped.grouped_mxfp4_gemm(x, blocks, w13, s13, gate_limit=7.0, register_unpack=True)
    act_ref = grouped_mxfp4_gemm_reference(x, blocks, w13, s13, gate_limit=7.0)
    used = blocks.pair_of_pos >= 0
    assert _relative_error(act[used], act_ref[used]) < 1e-2
    act_ref[~used] = 0
    out_ref = grouped_mxfp4_gemm_reference(
        act_ref, blocks, w2, s2, row_weight=pair_weight, out_dtype=torch.float32
    )
    out = grouped.grouped_mxfp4_gemm(act_ref, blocks, w2, s2, row_weight=pair_weight,
                                     out_dtype=torch.float32, register_unpack=True)  # fmt: skip
    assert _relative_error(out, out_ref) < 1e-3
    s2_large = s2.clone()
    s2_large[0, 0, 0] = 140  # 2^13: past the register unpack's exact range
    out_ref = grouped_mxfp4_gemm_reference(
        act_ref, blocks, w2, s2_large, row_weight=pair_weight, out_dtype=torch.float32
    )
    out = grouped.grouped_mxfp4_gemm(act_ref, blocks, w2, s2_large, row_weight=pair_weight,
                                     out_dtype=torch.float32)  # fmt: skip
    assert _relative_error(out, out_ref) < 1e-3


def test_launcher_refuses_shapes_it_does_not_take() -> None:
    blocks = align_to_experts(torch.zeros(4, 2, dtype=torch.long), 4, 256)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    weights = (torch.zeros(4, 8, 128, dtype=torch.int8), torch.zeros(4, 8, 8, dtype=torch.uint8))
    out = torch.empty(blocks.num_positions, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="blocks of 256"):
        gluon_decode.launch_decode(x, blocks, weights, out, 7.0, None)


@pytest.mark.skipif(not gluon_decode.AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    ("gated", "block_m"),
    [(True, 32), (False, 32), (True, 128), (False, 128)],
    ids=["gate_up", "down", "gate_up-prefill", "down-prefill"],
)
def test_compiled_kernel_keeps_its_schedule(gated: bool, block_m: int) -> None:
    """Compiled for sm90 here at the launch table's tiles (blocks of 32 rows: 256 tokens;
    128: prefill): the words and x rows arrive by 16-byte cp.async, the unpacked weights reach
    the wgmma without crossing threads (no shuffle, no shared-memory store), and each product
    is waited for with one still in flight (the tensor cores overlap the next unpack)."""
    pointers = {
        "x_ptr": "*bf16", "codes_ptr": "*i32", "scales_ptr": "*u8", "pair_of_pos_ptr": "*i32",
        "block_expert_ptr": "*i32", "row_weight_ptr": "*fp32",
        "out_ptr": "*bf16" if gated else "*fp32",
    }  # fmt: skip
    strides = ("stride_xm", "stride_ce", "stride_cn", "stride_se", "stride_sn", "stride_om")
    sizes = ("N", "K", "num_blocks", *strides)
    types = {**pointers, **dict.fromkeys(sizes, "i32"), "gate_limit": "fp32"}
    n, k = (2304, 5120) if gated else (5120, 2304)
    tiles = gluon_decode.decode_tiles(n, k, block_m, gated)
    constexprs = {
        "TOP_K": 6, "GATED": gated, "TOKEN_ROWS": gated, "HAS_ROW_WEIGHT": not gated,
        "BLOCK_M": block_m, "STAGES": tiles["stages"], "STORE_KERNEL_ORDER": gated,
        "EARLY_UP_WORDS": tiles.get("early_up_words", False),
        "GROUP_BLOCKS": tiles.get("group_blocks", 0),
    }  # fmt: skip
    ptx = compile_for_hopper(
        gluon_decode._decode_kernel,
        types,
        constexprs,
        set(types) - {"gate_limit"},
        {"num_warps": tiles["num_warps"]},
    )
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)
    assert "shfl" not in ptx and "st.shared" not in ptx
    assert re.search(r"wgmma\.wait_group\.sync\.aligned 1;", ptx)
    # gate and up per step; the down's two steps per iteration and its odd last step
    launches = 2 if gated else 3
    products = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_m}k16", ptx)
    assert len(products) == 8 * launches


def test_launcher_refuses_weights_off_their_copy_boundaries() -> None:
    """Scale words are read 4 bytes and code words 16 bytes at a time: a view starting
    elsewhere is refused, not read across its boundary."""
    blocks = align_to_experts(torch.zeros(4, 2, dtype=torch.long), 4, 16)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    codes = torch.zeros(4, 8, 128, dtype=torch.int8)
    scales = torch.zeros(4, 8, 9, dtype=torch.uint8)[:, :, 1:]  # rows 9 bytes apart
    out = torch.empty(blocks.num_positions, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="boundaries"):
        gluon_decode.launch_decode(x, blocks, (codes, scales), out, 7.0, None)


def test_launcher_refuses_a_register_cap_the_compiler_cannot_take() -> None:
    blocks = align_to_experts(torch.zeros(4, 2, dtype=torch.long), 4, 16)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    weights = (torch.zeros(4, 8, 128, dtype=torch.int8), torch.zeros(4, 8, 8, dtype=torch.uint8))
    out = torch.empty(blocks.num_positions, 4, dtype=torch.bfloat16)
    for cap in (8, 300):
        with pytest.raises(ValueError, match="register cap"):
            gluon_decode.launch_decode(x, blocks, weights, out, 7.0, None, max_registers=cap)
