"""The grouped MXFP4 expert GEMM: routing layout and reference on the CPU, kernel on CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.moe import MoE
from kernels import grouped_mxfp4_gemm as grouped_kernels
from kernels import grouped_mxfp4_gluon
from kernels.grouped_mxfp4_gemm import (
    DECODE_CANDIDATES,
    REGISTER_PREFILL_CANDIDATES,
    _launch_decode,
    _launch_prefill,
    align_to_experts,
    grouped_mxfp4_gemm,
    grouped_mxfp4_gemm_reference,
    reads_kernel_order,
)
from tests.kernels.interpreted import run_interpreted


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    # Skewed: a few experts get most rows, some none (as real routings do).
    scores = torch.rand(num_tokens, num_experts, generator=generator) ** 4
    scores[:, : num_experts // 4] += 0.5
    return torch.topk(scores, top_k, dim=-1).indices.to(device)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [(1, 8, 2, 16), (37, 6, 3, 16), (300, 48, 6, 16), (300, 48, 6, 64), (5, 64, 6, 32)],
)
def test_alignment_places_every_pair_once_in_expert_pure_blocks(
    num_tokens: int, num_experts: int, top_k: int, block_m: int
) -> None:
    ids = _routing(num_tokens, num_experts, top_k, seed=num_tokens)
    blocks = align_to_experts(ids, num_experts, block_m)
    pairs = blocks.pair_of_pos
    assert sorted(pairs[pairs >= 0].tolist()) == list(range(num_tokens * top_k))
    expert_of_pos = blocks.block_expert.long().repeat_interleave(block_m)
    used = pairs >= 0
    assert torch.equal(expert_of_pos[used], ids.flatten()[pairs[used].long()])
    # Each expert's rows are one run starting at a block boundary; padding only ends a run.
    for expert in range(num_experts):
        positions = torch.nonzero(used & (expert_of_pos == expert)).flatten()
        if len(positions):
            assert positions[0] % block_m == 0
            assert torch.equal(positions, torch.arange(positions[0], positions[0] + len(positions)))
    assert blocks.num_pairs == num_tokens * top_k


@pytest.mark.parametrize("num_tokens", [1, 300, 683])
def test_counted_and_sorted_alignment_lay_out_the_same_blocks(num_tokens, monkeypatch) -> None:
    """Up to COUNTED_RANK_MAX_PAIRS pairs rank within their expert by a prefix count, above by
    a stable sort: the same blocks either way, skipped (-1) pairs included."""
    import kernels.expert_alignment as module

    ids = _routing(num_tokens, 48, 6, seed=7)
    ids[::5, 1] = -1
    layouts = []
    for limit in (0, 10**6):  # every routing sorted, then every routing counted
        monkeypatch.setattr(module, "COUNTED_RANK_MAX_PAIRS", limit)
        layouts.append(align_to_experts(ids, 48, 16))
    assert torch.equal(layouts[0].pair_of_pos, layouts[1].pair_of_pos)
    assert torch.equal(layouts[0].block_expert, layouts[1].block_expert)


def _quantized_moe(dim: int, inter: int, num_experts: int, top_k: int, seed: int) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dim, inter, num_experts, top_k, 2.5, 7.0, torch.bfloat16, quantized_experts=True)
    return fill_random(moe)


def fill_random(moe: MoE) -> MoE:
    """Random MXFP4 codes, e8m0 scales 2^-7..2^-4 and N(0, 0.05) parameters, from torch's
    global generator (seed it first)."""
    with torch.no_grad():
        for tensor in moe.buffers():
            if tensor.dtype == torch.int8:
                tensor.copy_(torch.randint(-128, 128, tensor.shape, dtype=torch.int8))
            else:
                exponent = torch.randint(120, 124, tensor.shape, dtype=torch.uint8)
                tensor.copy_(exponent.view(torch.float8_e8m0fnu))
        for parameter in moe.parameters():
            parameter.normal_(0.0, 0.05)
    return moe


def _routed_by_reference(moe: MoE, x: torch.Tensor, block_m: int) -> torch.Tensor:
    ids, weights = moe.route(x)
    blocks = align_to_experts(ids, len(moe.experts), block_m)
    pair_weight = weights.flatten().contiguous()
    before = moe.weight_before_down
    act = grouped_mxfp4_gemm_reference(
        x,
        blocks,
        moe.w13_codes,
        moe.w13_scales,
        gate_limit=moe.experts[0].limit,
        row_weight=pair_weight if before else None,
    )
    per_slot = grouped_mxfp4_gemm_reference(
        act,
        blocks,
        moe.w2_codes,
        moe.w2_scales,
        row_weight=None if before else pair_weight,
        out_dtype=torch.float32,
    )
    return per_slot.view(x.shape[0], moe.top_k, -1).sum(1)


@pytest.mark.parametrize("weight_before_down", [False, True])
def test_reference_composes_into_the_moe_layer(weight_before_down: bool) -> None:
    moe = _quantized_moe(dim=64, inter=96, num_experts=8, top_k=3, seed=1)
    moe.weight_before_down = weight_before_down
    x = torch.randn(21, 64).bfloat16()
    expected = moe(x)  # the per-expert reference path (CPU)
    moe.pack_experts()
    assert torch.equal(moe(x), expected)  # packing changes no value
    routed = _routed_by_reference(moe, x, block_m=16)
    ours = (moe.shared_experts(x).float() + routed).bfloat16()
    error = (ours.float() - expected.float()).norm() / expected.float().norm()
    assert error < 1e-2


def test_launcher_rejects_layouts_it_cannot_take() -> None:
    ids = _routing(4, 8, 2, seed=0)
    blocks = align_to_experts(ids, 8, 16)
    codes = torch.zeros(8, 64, 32, dtype=torch.int8)
    scales = torch.zeros(8, 64, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bf16"):
        grouped_mxfp4_gemm(torch.zeros(4, 64), blocks, codes, scales, gate_limit=7.0)
    with pytest.raises(ValueError, match="CUDA"):
        grouped_mxfp4_gemm(torch.zeros(4, 64).bfloat16(), blocks, codes, scales, gate_limit=7.0)


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.detach().float() - reference.float()).norm() / reference.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "dim", "inter", "num_experts", "top_k", "block_m"),
    [
        (1, 256, 128, 8, 2, 16),
        (64, 5120, 2304, 8, 6, 16),  # decode-like, real widths
        (600, 1024, 512, 16, 6, 64),  # prefill-like
        (300, 1024, 384, 8, 6, 128),  # prefill blocks of 128
        (40, 640, 224, 8, 6, 32),  # decode tiles: N tails, down K not a multiple of 128
        (33, 96, 160, 4, 3, 32),  # K not a multiple of 64
    ],
)
def test_kernel_matches_reference(
    num_tokens: int, dim: int, inter: int, num_experts: int, top_k: int, block_m: int
) -> None:
    device = "cuda"
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, dim, device=device).bfloat16()
    ids = _routing(num_tokens, num_experts, top_k, seed=num_tokens, device=device)
    blocks = align_to_experts(ids, num_experts, block_m)
    pair_weight = torch.rand(num_tokens * top_k, device=device)
    w13 = torch.randint(-128, 128, (num_experts, 2 * inter, dim // 2), dtype=torch.int8)
    # Scales up to 2^1 (e8m0 128), the decode kernel's exact range, spread over 2^±9.
    s13 = torch.randint(119, 129, (num_experts, 2 * inter, dim // 32), dtype=torch.uint8)
    w2 = torch.randint(-128, 128, (num_experts, dim, inter // 2), dtype=torch.int8)
    s2 = torch.randint(110, 129, (num_experts, dim, inter // 32), dtype=torch.uint8)
    w13, s13, w2, s2 = (t.to(device) for t in (w13, s13, w2, s2))
    used = blocks.pair_of_pos >= 0
    for row_weight in (None, pair_weight):
        act = grouped_mxfp4_gemm(x, blocks, w13, s13, gate_limit=7.0, row_weight=row_weight)
        act_ref = grouped_mxfp4_gemm_reference(
            x, blocks, w13, s13, gate_limit=7.0, row_weight=row_weight
        )
        assert _relative_error(act[used], act_ref[used]) < 1e-2
    act_ref[~used] = 0
    down = {"row_weight": pair_weight, "out_dtype": torch.float32}
    out = grouped_mxfp4_gemm(act_ref, blocks, w2, s2, **down)
    out_ref = grouped_mxfp4_gemm_reference(act_ref, blocks, w2, s2, **down)
    assert _relative_error(out, out_ref) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", DECODE_CANDIDATES, ids=lambda t: f"{t['BLOCK_N']}-{t['maxnreg']}")
@pytest.mark.parametrize(
    ("num_tokens", "dim", "inter", "block_m"),
    [(64, 5120, 2304, 16), (256, 1024, 224, 32)],  # real widths; N tails of 64 and 128 rows
)
def test_every_decode_candidate_matches_reference(
    tiles: dict, num_tokens: int, dim: int, inter: int, block_m: int
) -> None:
    device, num_experts, top_k = "cuda", 8, 6
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, dim, device=device).bfloat16()
    blocks = align_to_experts(
        _routing(num_tokens, num_experts, top_k, seed=num_tokens, device=device),
        num_experts,
        block_m,
    )
    weights = decode_expert_weights(num_experts, dim, inter, device)
    _both_launches_match_reference(_launch_decode, x, None, blocks, weights, tiles)


def decode_expert_weights(num_experts: int, dim: int, inter: int, device: str) -> tuple:
    """Random gate/up and down experts (codes, scales) of the given widths, the scale codes up
    to 128 (2^1: the decode kernels' exact range) and spread over 2^±9."""
    w13 = torch.randint(-128, 128, (num_experts, 2 * inter, dim // 2), dtype=torch.int8)
    s13 = torch.randint(119, 129, (num_experts, 2 * inter, dim // 32), dtype=torch.uint8)
    w2 = torch.randint(-128, 128, (num_experts, dim, inter // 2), dtype=torch.int8)
    s2 = torch.randint(110, 129, (num_experts, dim, inter // 32), dtype=torch.uint8)
    return tuple(t.to(device) for t in (w13, s13, w2, s2))


def _both_launches_match_reference(launch, x, down_rows, blocks, weights, tiles) -> tuple:
    """`launch` (a kernel launcher) of gate/up on x, then of down on `down_rows` (None: the
    reference's SwiGLU rows), each against the reference; returns the down's inputs."""
    w13, s13, w2, s2 = weights
    used = blocks.pair_of_pos >= 0
    act = torch.zeros(blocks.num_positions, w13.shape[1] // 2, dtype=torch.bfloat16,
                      device=x.device)  # fmt: skip
    launch(x, blocks, (w13, s13), act, 7.0, None, **tiles)
    act_ref = grouped_mxfp4_gemm_reference(x, blocks, w13, s13, gate_limit=7.0)
    assert _relative_error(act[used], act_ref[used]) < 1e-2
    act_ref[~used] = 0
    rows = act_ref if down_rows is None else down_rows
    pair_weight = torch.rand(blocks.num_pairs, device=x.device)
    out = torch.empty(blocks.num_pairs, w2.shape[1], device=x.device)
    launch(rows, blocks, (w2, s2), out, None, pair_weight, **tiles)
    out_ref = grouped_mxfp4_gemm_reference(
        rows, blocks, w2, s2, row_weight=pair_weight, out_dtype=torch.float32
    )
    assert _relative_error(out, out_ref) < 1e-3
    return rows, pair_weight, out_ref


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tiles",
    REGISTER_PREFILL_CANDIDATES,
    ids=lambda t: f"{t['BLOCK_N']}-{t['num_warps']}-{t['num_stages']}",
)
@pytest.mark.parametrize(
    ("num_tokens", "block_m", "gate_up", "down"),
    [
        (600, 64, (1024, 352), (384, 1088)),  # (K, N) of each; N tails of 32 and 64 columns
        (300, 128, (5120, 2304), (2304, 5120)),  # the released widths
    ],
)
def test_every_register_prefill_candidate_matches_reference(
    tiles: dict, num_tokens: int, block_m: int, gate_up: tuple, down: tuple
) -> None:
    """The prefill kernel with the decode kernel's in-register unpack (scale codes <= 128)."""
    device, num_experts, top_k = "cuda", 8, 6
    torch.manual_seed(num_tokens)
    blocks = align_to_experts(
        _routing(num_tokens, num_experts, top_k, seed=num_tokens, device=device),
        num_experts,
        block_m,
    )
    used = blocks.pair_of_pos >= 0
    (k13, inter), (k2, n2) = gate_up, down
    x = torch.randn(num_tokens, k13, device=device).bfloat16()
    w13 = torch.randint(-128, 128, (num_experts, 2 * inter, k13 // 2), dtype=torch.int8)
    s13 = torch.randint(100, 129, (num_experts, 2 * inter, k13 // 32), dtype=torch.uint8)
    w2 = torch.randint(-128, 128, (num_experts, n2, k2 // 2), dtype=torch.int8)
    s2 = torch.randint(100, 129, (num_experts, n2, k2 // 32), dtype=torch.uint8)
    w13, s13, w2, s2 = (t.to(device) for t in (w13, s13, w2, s2))
    rows = torch.randn(blocks.num_positions, k2, device=device).bfloat16()
    rows[~used] = 0
    weights = (w13, s13, w2, s2)
    _both_launches_match_reference(_launch_prefill, x, rows, blocks, weights, tiles)
    # the launcher's gate/up takes the register unpack (the down keeps its table)
    table = grouped_mxfp4_gemm(x, blocks, w13, s13, gate_limit=7.0, register_unpack=True)
    act_ref = grouped_mxfp4_gemm_reference(x, blocks, w13, s13, gate_limit=7.0)
    assert _relative_error(table[used], act_ref[used]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_moe_on_cuda_uses_the_kernel_and_matches_the_reference_path(num_tokens: int) -> None:
    moe = _quantized_moe(dim=512, inter=256, num_experts=16, top_k=6, seed=2).cuda()
    x = torch.randn(num_tokens, 512, device="cuda").bfloat16()
    expected = moe(x)  # unpacked: the per-expert path
    moe.pack_experts()
    grouped = moe(x)
    assert _relative_error(grouped, expected) < 1e-2


def test_alignment_skips_pairs_marked_minus_one() -> None:
    """An EP rank's received rows: slots served elsewhere (−1) get no position; the others are
    laid out exactly as the routing without them."""
    ids = _routing(40, 8, 3, seed=5)
    skipped = torch.rand(40, 3, generator=torch.Generator().manual_seed(6)) < 0.6
    skipped[:, 0] &= ~skipped.all(1)
    marked = torch.where(skipped, torch.full_like(ids, -1), ids)
    marked[7] = -1  # a padding row
    blocks = align_to_experts(marked, 8, 16)
    pairs = blocks.pair_of_pos
    kept = (marked.flatten() >= 0).nonzero().flatten()
    assert sorted(pairs[pairs >= 0].tolist()) == kept.tolist()
    expert_of_pos = blocks.block_expert.long().repeat_interleave(16)
    used = pairs >= 0
    assert torch.equal(expert_of_pos[used], marked.flatten()[pairs[used].long()])
    assert blocks.num_positions == (40 * 3 // 16 + 8) * 16  # the bound counts every slot
    nothing = align_to_experts(torch.full((4, 3), -1), 8, 16)
    assert (nothing.pair_of_pos == -1).all() and (nothing.block_expert == -1).all()


_KERNEL_ORDER = """
import json, torch
from kernels.grouped_mxfp4_gemm import _kernel_columns, align_to_experts, grouped_mxfp4_gemm
from kernels.grouped_mxfp4_gemm import reads_kernel_order
from tests.kernels.test_grouped_mxfp4_gemm import _routing
torch.manual_seed(0)
experts, top_k, k, n = 4, 2, 128, 256
x = torch.randn(40, k).bfloat16()
blocks = align_to_experts(_routing(40, experts, top_k, seed=3), experts, 64)
codes = torch.randint(-128, 128, (experts, 2 * n, k // 2), dtype=torch.int8)
scales = torch.randint(118, 126, (experts, 2 * n, k // 32), dtype=torch.uint8)
plain = grouped_mxfp4_gemm(x, blocks, codes, scales, gate_limit=7.0)
ordered = grouped_mxfp4_gemm(x, blocks, codes, scales, gate_limit=7.0, out_kernel_order=True)
used = blocks.pair_of_pos >= 0
expected = plain.view(-1, n // 128, 128)[:, :, _kernel_columns(x.device)].view(-1, n)
refused = []
rows = torch.zeros(blocks.num_positions, k).bfloat16()
try:
    grouped_mxfp4_gemm(rows, blocks, codes[:, :n], scales[:, :n], x_kernel_order=True)
except ValueError as error:
    refused.append(str(error))
try:
    grouped_mxfp4_gemm(x, blocks, codes[:, :96], scales[:, :96], gate_limit=7.0,
                       out_kernel_order=True)
except ValueError as error:
    refused.append(str(error))
print(json.dumps([torch.equal(ordered[used].view(torch.int16), expected[used].view(torch.int16)),
                  refused, reads_kernel_order(2304, 16)]))
"""


def test_a_gate_up_output_in_kernel_order_is_the_plain_one_reordered() -> None:
    """`out_kernel_order`: each row's columns written where the down GEMM's reordering copy
    would put them (bit for bit, the prefill kernel in the interpreter); what cannot take the
    order is refused, and the interpreter never reads it (its tiles read x as it is)."""
    same, refused, interpreter_reads = run_interpreted(_KERNEL_ORDER)
    assert same
    assert "reads x as it is" in refused[0] and "N % 128" in refused[1]
    assert not interpreter_reads


def test_the_kernel_order_is_read_by_the_tiles_that_reorder_x() -> None:
    assert reads_kernel_order(2304, 16) and reads_kernel_order(5120, 32)
    assert not reads_kernel_order(2304, 64)  # the prefill tiles read x as it is
    # blocks of 128 read the kernel's order only through the Gluon kernel: a Hopper GPU
    assert not reads_kernel_order(2304, 128, exact_unpack=True, x=torch.zeros(1, 2304))
    assert not reads_kernel_order(224, 16)  # K not a multiple of 128: no reordering
    assert not reads_kernel_order(2304, 16, fixed_tiles=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32])
def test_kernel_order_between_gate_up_and_down_gives_the_plain_results_on_cuda(
    block_m: int,
) -> None:
    """The decode kernel writing the SwiGLU rows in the kernel's K order, and the down GEMM
    reading them as they are: the same bits as the plain order with the launcher's
    reordering copy."""
    device, num_experts, top_k, dim, inter, num_tokens = "cuda", 8, 6, 1024, 384, 200
    torch.manual_seed(block_m)
    x = torch.randn(num_tokens, dim, device=device).bfloat16()
    blocks = align_to_experts(
        _routing(num_tokens, num_experts, top_k, seed=5, device=device), num_experts, block_m
    )
    w13 = torch.randint(-128, 128, (num_experts, 2 * inter, dim // 2), dtype=torch.int8)
    s13 = torch.randint(119, 129, (num_experts, 2 * inter, dim // 32), dtype=torch.uint8)
    w2 = torch.randint(-128, 128, (num_experts, dim, inter // 2), dtype=torch.int8)
    s2 = torch.randint(110, 129, (num_experts, dim, inter // 32), dtype=torch.uint8)
    w13, s13, w2, s2 = (t.to(device) for t in (w13, s13, w2, s2))
    assert reads_kernel_order(inter, block_m)
    results = []
    for order in (False, True):
        act = grouped_mxfp4_gemm(x, blocks, w13, s13, gate_limit=7.0, out_kernel_order=order)
        act[blocks.pair_of_pos < 0] = 0
        results.append(
            grouped_mxfp4_gemm(act, blocks, w2, s2, out_dtype=torch.float32, x_kernel_order=order)
        )
    assert torch.equal(results[0], results[1])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_moe_reading_its_input_in_kernel_order_gives_the_plain_results_on_cuda(
    num_tokens: int,
) -> None:
    """A decode step's MoE handed its input in the kernel's K order too (what the block's
    fused residual update writes): its gate/up reads that copy, the result is the same bits."""
    from kernels.grouped_mxfp4_gemm import _in_kernel_order

    moe = _quantized_moe(dim=512, inter=256, num_experts=16, top_k=6, seed=3).cuda()
    moe.pack_experts()
    x = torch.randn(num_tokens, 512, device="cuda").bfloat16()
    assert moe.reads_x_in_kernel_order(x)
    assert torch.equal(moe(x, _in_kernel_order(x)), moe(x))
    prefill = torch.randn(4096, 512, device="cuda").bfloat16()
    # Blocks of 128 rows: the Gluon kernel reads the kernel's order, the Triton prefill tiles
    # read x as it is.
    gluon_prefill = grouped_kernels.PREFILL_KERNEL == "gluon"
    gluon_prefill = gluon_prefill and grouped_mxfp4_gluon.runs_here(prefill)
    assert moe.reads_x_in_kernel_order(prefill) == gluon_prefill
    if gluon_prefill:
        assert torch.equal(moe(prefill, _in_kernel_order(prefill)), moe(prefill))


def test_moe_off_the_kernel_path_reads_its_input_as_it_is() -> None:
    moe = _quantized_moe(dim=256, inter=128, num_experts=8, top_k=2, seed=4)
    moe.pack_experts()
    x = torch.randn(5, 256).bfloat16()
    assert not moe.reads_x_in_kernel_order(x)  # the CPU (no interpreter): the torch path
