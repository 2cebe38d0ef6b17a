"""The grouped MXFP4 GEMM's decode kernel written in Gluon for Hopper: the same product as
`grouped_mxfp4_gemm._decode_kernel` (outᵀ = W · xᵀ per expert block, the weights unpacked in
registers as the wgmma's A operand, a block's token rows its N) with the memory and the tensor
cores scheduled by hand, which Triton's `tl.dot` path cannot express:

* a ring of STAGES shared-memory slots filled by `cp.async`: the weight words, their scales and
  the block's x rows of step k + STAGES − 2 are in flight while step k computes (the Triton
  kernel prefetched one step into registers, too short to cover the DRAM latency at 256
  tokens: Nsight Compute, 2026-12-07, found 26 % of the warps' stalls waiting on those loads
  and 18 % at the barrier that staged x);
* the x tile goes from global memory to the wgmma's shared-memory operand directly (no
  register round trip, no store, one barrier per step);
* the wgmmas are asynchronous and waited for one step late (gate/up: each matrix's product is
  waited for while the other matrix is unpacked), so the tensor cores overlap the unpack;
* the words land in registers in the wgmma A operand's own layout (`_words_layout`), so the
  unpack feeds the wgmma without moving data between threads.

Contract (what the launcher checks and `grouped_mxfp4_gemm` relies on): K a multiple of 128, x
in the kernel's K order (`grouped_mxfp4_gemm._kernel_columns`), e8m0 scale codes <= 128 (the
unpack's NOTE in `grouped_mxfp4_gemm`), blocks of 16, 32, 64 or 128 rows (the launcher gives
it blocks of up to 32, and prefill's blocks of 128 where `grouped_mxfp4_gemm.PREFILL_KERNEL`
says so; 64 is a candidate). The torch reference is `grouped_mxfp4_gemm_reference`; the `gpu`
tests compare both kernels with it.

Gluon is experimental: `AVAILABLE` is False where this Triton has no Gluon or a Gluon without
the calls used here, and the launcher then keeps the Triton kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import on_sm90
from kernels.expert_alignment import ExpertBlocks
from kernels.mxfp4_unpack import UNPACK_0, UNPACK_1, UNPACK_2, UNPACK_3

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    # Triton 3.6 names the cp.async copy `async_copy_global_to_shared`, later ones `async_load`
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    AVAILABLE = True
except (ImportError, AttributeError):  # a Triton without (this) Gluon
    AVAILABLE = False

STEP_K = 128  # K columns per step: 16 words of codes per weight row
STAGES = 4  # ring slots: steps in flight = STAGES - 2


if AVAILABLE:
    _STEP_K = gl.constexpr(STEP_K)

    @gluon.constexpr_function
    def _words_layout(num_warps):
        """[16 · num_warps weight rows, 16 words] with lane quad q holding words 4q .. 4q + 3 of
        rows r and r + 8 (r = lane // 4 within its warp's 16 rows): the unpacked values are then
        the wgmma A operand's registers (`grouped_mxfp4_gemm._weight_tile` gives the K order)."""
        warp_bases = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]],
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=warp_bases,
            block_bases=[],
            shape=[16 * num_warps, 16],
        )

    @gluon.constexpr_function
    def _x_layout(num_warps):
        """[rows, 128] bf16 tiles of x: 16 contiguous bytes per thread (one cp.async each)."""
        return gl.BlockedLayout(
            size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[num_warps, 1],
            order=[1, 0],
        )  # fmt: skip

    @gluon.constexpr_function
    def _acc_layout(num_warps, block_m):
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16]
        )

    @gluon.jit
    def _as_bf16_pairs(packed):
        low = (packed & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
        return gl.join(low, (packed >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True))

    @gluon.jit
    def _unpack(words, scale_words, A_LAYOUT: gl.constexpr):
        """bf16 [rows, 128] in the wgmma A layout of one step's words [rows, 16] (`_words_layout`)
        and scale words [rows] (byte q: the scale of words 4q .. 4q + 3)."""
        rows: gl.constexpr = words.shape[0]
        quad = gl.arange(0, 16, layout=gl.SliceLayout(0, words.type.layout)) // 4
        scales = (scale_words[:, None] >> (8 * quad)[None, :]) & 0xFF
        multiplier = (scales + 126) << 7  # bf16 2^(scale - 1)
        multiplier = multiplier | (multiplier << 16)
        args = [words, multiplier]
        out0 = gl.inline_asm_elementwise(UNPACK_0, "=r,r,r", args, gl.int32, is_pure=True, pack=1)
        out1 = gl.inline_asm_elementwise(UNPACK_1, "=r,r,r", args, gl.int32, is_pure=True, pack=1)
        out2 = gl.inline_asm_elementwise(UNPACK_2, "=r,r,r", args, gl.int32, is_pure=True, pack=1)
        out3 = gl.inline_asm_elementwise(UNPACK_3, "=r,r,r", args, gl.int32, is_pure=True, pack=1)
        pairs = gl.join(
            gl.join(_as_bf16_pairs(out0), _as_bf16_pairs(out1)),
            gl.join(_as_bf16_pairs(out2), _as_bf16_pairs(out3)),
        )  # [rows, word = 4q + w, h, j & 1, j >> 1]
        pairs = gl.reshape(pairs, [rows, 4, 4, 2, 2, 2])  # [rows, q, w, h, j & 1, j >> 1]
        pairs = gl.permute(pairs, [0, 2, 5, 4, 1, 3])  # [rows, w, j >> 1, j & 1, q, h]
        return gl.convert_layout(gl.reshape(pairs, [rows, 128]), A_LAYOUT)

    @gluon.jit
    def _unpack_slot(words_smem, scales_smem, slot, A_LAYOUT: gl.constexpr):
        """The A operand of ring slot `slot`'s words and scales (`_unpack`)."""
        words_layout: gl.constexpr = _words_layout(gl.num_warps())
        words = words_smem.index(slot).load(words_layout)
        scales = scales_smem.index(slot).load(gl.SliceLayout(1, words_layout))
        return _unpack(words, scales, A_LAYOUT)

    @gluon.jit
    def _issue_step(step, num_steps, slot, word_ptrs, word_up_ptrs, scale_ptrs, scale_up_ptrs,
                    x_ptrs, words_smem, words_up_smem, scales_smem, scales_up_smem, x_smem,
                    GATED: gl.constexpr):  # fmt: skip
        """cp.async of step `step`'s words, scales and x rows into ring slot `slot` (nothing
        when step >= num_steps), one commit group."""
        live = step < num_steps
        word_mask = gl.full(word_ptrs.shape, 0, gl.int32, word_ptrs.type.layout) == 0
        word_mask = word_mask & live
        scale_mask = gl.full(scale_ptrs.shape, 0, gl.int32, scale_ptrs.type.layout) == 0
        scale_mask = scale_mask & live
        x_mask = gl.full(x_ptrs.shape, 0, gl.int32, x_ptrs.type.layout) == 0
        x_mask = x_mask & live
        word_offset = step * (_STEP_K // 8)
        scale_offset = step * (_STEP_K // 128)  # one word of four scale bytes per step
        _async_load(words_smem.index(slot), word_ptrs + word_offset, mask=word_mask)
        _async_load(scales_smem.index(slot), scale_ptrs + scale_offset, mask=scale_mask)
        if GATED:
            _async_load(words_up_smem.index(slot), word_up_ptrs + word_offset, mask=word_mask)
            _async_load(scales_up_smem.index(slot), scale_up_ptrs + scale_offset, mask=scale_mask)
        _async_load(x_smem.index(slot), x_ptrs + step * _STEP_K, mask=x_mask)
        async_copy.commit_group()

    @gluon.jit
    def _ready(step, num_steps, word_ptrs, word_up_ptrs, scale_ptrs, scale_up_ptrs, x_ptrs,
               words_smem, words_up_smem, scales_smem, scales_up_smem, x_smem,
               STAGES: gl.constexpr, GATED: gl.constexpr):  # fmt: skip
        """Wait for step `step`'s slot and start the copies of step + STAGES - 2 into the slot
        that step - 2 used; returns the step's slot. This thread's copies are done and fenced
        for the wgmma's async proxy; the compiler's barriers follow (after the wait, and before
        the slot's reads), so all threads' copies are visible, and every wgmma of step - 2 has
        been waited for before its slot is refilled."""
        async_copy.wait_group(STAGES - 3)
        fence_async_shared()
        ahead = step + STAGES - 2
        _issue_step(ahead, num_steps, ahead % STAGES, word_ptrs, word_up_ptrs, scale_ptrs,
                    scale_up_ptrs, x_ptrs, words_smem, words_up_smem, scales_smem,
                    scales_up_smem, x_smem, GATED)  # fmt: skip
        return step % STAGES

    @gluon.jit
    def _grouped_program(num_blocks, num_tiles, GROUP_BLOCKS: gl.constexpr):
        """(block, column tile) of a one-axis grid ordered in groups of GROUP_BLOCKS blocks:
        within a group the blocks are fastest, then the column tiles, so the programs running
        together read a few blocks' x rows and their experts' weights, which L2 keeps."""
        program = gl.program_id(0)
        per_group = GROUP_BLOCKS * num_tiles
        first = (program // per_group) * GROUP_BLOCKS
        size = gl.minimum(num_blocks - first, GROUP_BLOCKS)
        within = program % per_group
        return first + within % size, within // size

    @gluon.jit
    def _block_and_tile(num_blocks, num_tiles, GROUP_BLOCKS: gl.constexpr):
        """This program's (block, column tile): in groups of GROUP_BLOCKS blocks on a one-axis
        grid (`_grouped_program`), or on a two-axis grid with the blocks fastest (0)."""
        if GROUP_BLOCKS:
            block, tile = _grouped_program(num_blocks, num_tiles, GROUP_BLOCKS)
        else:
            block = gl.program_id(0)
            tile = gl.program_id(1)
        return block, tile

    @gluon.jit
    def _store_block(acc, acc_up, block, tile, out_ptr, pair_of_pos_ptr, row_weight_ptr, N,
                     gate_limit, stride_om, GATED: gl.constexpr, TOKEN_ROWS: gl.constexpr,
                     HAS_ROW_WEIGHT: gl.constexpr, STORE_KERNEL_ORDER: gl.constexpr):  # fmt: skip
        """Store one program's outᵀ tile acc [weight rows, block rows] (gate/up: the clamped
        SwiGLU of acc and acc_up) at the block's output rows: positions (gate/up) or pairs
        (down), the routing weight multiplied in where given, padding positions and columns
        past N not written."""
        BLOCK_N: gl.constexpr = acc.shape[0]
        BLOCK_M: gl.constexpr = acc.shape[1]
        acc_layout: gl.constexpr = acc.type.layout
        out_pos = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
        pair = gl.load(pair_of_pos_ptr + out_pos)
        is_row = pair >= 0
        if GATED:
            gate = gl.minimum(acc, gate_limit)
            up = gl.minimum(gl.maximum(acc_up, -gate_limit), gate_limit)
            acc = gate / (1.0 + gl.exp(-gate)) * up
        if HAS_ROW_WEIGHT:
            weight = gl.load(row_weight_ptr + gl.where(is_row, pair, 0), mask=is_row, other=0.0)
            acc = acc * weight[None, :]
        out_row = out_pos if TOKEN_ROWS else pair
        out_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        if STORE_KERNEL_ORDER:  # `grouped_mxfp4_gemm._kernel_order`
            c = out_n & 127
            word = c >> 3
            within = c & 7
            out_col = (out_n - c) + ((within >> 2) | ((word >> 2) << 1) | ((within & 3) << 3)
                                     | ((word & 3) << 5))  # fmt: skip
        else:
            out_col = out_n
        gl.store(
            out_ptr + out_row.to(gl.int64)[None, :] * stride_om + out_col[:, None],
            acc.to(out_ptr.dtype.element_ty),
            mask=is_row[None, :] & (out_n < N)[:, None],
        )

    @gluon.jit(do_not_specialize=["num_blocks"])  # step-varying: one variant
    def _decode_kernel(
        x_ptr,
        codes_ptr,
        scales_ptr,
        out_ptr,
        pair_of_pos_ptr,
        block_expert_ptr,
        row_weight_ptr,
        N,
        K,
        num_blocks,
        gate_limit,
        stride_xm,
        stride_ce,
        stride_cn,
        stride_se,
        stride_sn,
        stride_om,
        TOP_K: gl.constexpr,
        GATED: gl.constexpr,
        TOKEN_ROWS: gl.constexpr,
        HAS_ROW_WEIGHT: gl.constexpr,
        BLOCK_M: gl.constexpr,
        STAGES: gl.constexpr,
        STORE_KERNEL_ORDER: gl.constexpr,
        EARLY_UP_WORDS: gl.constexpr,
        GROUP_BLOCKS: gl.constexpr,
    ):
        num_warps: gl.constexpr = gl.num_warps()
        BLOCK_N: gl.constexpr = 16 * num_warps
        words_layout: gl.constexpr = _words_layout(num_warps)
        rows_layout: gl.constexpr = gl.SliceLayout(1, words_layout)
        x_layout: gl.constexpr = _x_layout(num_warps)
        acc_layout: gl.constexpr = _acc_layout(num_warps, BLOCK_M)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        plain_1d: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        x_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [BLOCK_M, _STEP_K], gl.bfloat16
        )

        block, tile = _block_and_tile(num_blocks, gl.cdiv(N, BLOCK_N), GROUP_BLOCKS)
        expert = gl.load(block_expert_ptr + block)
        if expert < 0:
            return
        num_steps = K // _STEP_K

        # the x rows of the block's positions (padding positions read row 0, never stored)
        x_pos = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
        x_pair = gl.load(pair_of_pos_ptr + x_pos)
        in_row = gl.where(x_pair >= 0, x_pair // TOP_K, 0) if TOKEN_ROWS else x_pos
        x_cols = gl.arange(0, _STEP_K, layout=gl.SliceLayout(0, x_layout))
        x_ptrs = x_ptr + in_row.to(gl.int64)[:, None] * stride_xm + x_cols[None, :]

        # this program's weight rows (tail rows recompute row N - 1, never stored)
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_layout)
        offs_n = gl.where(offs_n < N, offs_n, N - 1)
        words_ptr = codes_ptr + expert.to(gl.int64) * (stride_ce // 4)
        word_cols = gl.arange(0, 16, layout=gl.SliceLayout(0, words_layout))
        word_ptrs = words_ptr + offs_n[:, None] * (stride_cn // 4) + word_cols[None, :]
        word_up_ptrs = word_ptrs + N * (stride_cn // 4)
        scale_words_ptr = (scales_ptr + expert.to(gl.int64) * stride_se).to(
            gl.pointer_type(gl.int32)
        )
        scale_ptrs = scale_words_ptr + offs_n * (stride_sn // 4)
        scale_up_ptrs = scale_ptrs + N * (stride_sn // 4)

        words_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16], plain)
        scales_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], plain_1d)
        if GATED:
            words_up_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16], plain)
            scales_up_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], plain_1d)
        else:
            words_up_smem = words_smem
            scales_up_smem = scales_smem
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, _STEP_K], x_shared)

        for step in gl.static_range(STAGES - 2):
            _issue_step(step, num_steps, step, word_ptrs, word_up_ptrs, scale_ptrs, scale_up_ptrs,
                        x_ptrs, words_smem, words_up_smem, scales_smem, scales_up_smem, x_smem,
                        GATED)  # fmt: skip

        # loop-carried as wgmma accumulators: a product may still be in flight at a step's end
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
        if GATED:
            acc_up = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout))
            a_up = gl.zeros([BLOCK_N, _STEP_K], gl.bfloat16, a_layout)
            for step in range(num_steps):
                slot = _ready(step, num_steps, word_ptrs, word_up_ptrs, scale_ptrs, scale_up_ptrs,
                              x_ptrs, words_smem, words_up_smem, scales_smem, scales_up_smem,
                              x_smem, STAGES, GATED)  # fmt: skip
                x_tile = x_smem.index(slot).permute((1, 0))
                if EARLY_UP_WORDS:  # the up's words arrive during the gate's unpack
                    words_up = words_up_smem.index(slot).load(words_layout)
                    scales_up = scales_up_smem.index(slot).load(rows_layout)
                a = _unpack_slot(words_smem, scales_smem, slot, a_layout)
                acc = warpgroup_mma(a, x_tile, acc, is_async=True)
                # up of step - 1 done (its A registers free) while the gate product runs
                acc_up, a_up = warpgroup_mma_wait(1, deps=(acc_up, a_up))
                if EARLY_UP_WORDS:
                    a_up = _unpack(words_up, scales_up, a_layout)
                else:
                    a_up = _unpack_slot(words_up_smem, scales_up_smem, slot, a_layout)
                acc_up = warpgroup_mma(a_up, x_tile, acc_up, is_async=True)
                acc, a = warpgroup_mma_wait(1, deps=(acc, a))  # gate of this step done
            acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
        else:
            # Two steps per iteration, so that the A operand unpacked while the other step's
            # product is in flight is another value in other registers (a loop-carried copy
            # would let the next unpack overwrite registers the tensor cores still read).
            acc = warpgroup_mma_init(acc)
            a_odd = gl.zeros([BLOCK_N, _STEP_K], gl.bfloat16, a_layout)
            for pair_step in range(num_steps // 2):
                slot = _ready(2 * pair_step, num_steps, word_ptrs, word_up_ptrs, scale_ptrs,
                              scale_up_ptrs, x_ptrs, words_smem, words_up_smem, scales_smem,
                              scales_up_smem, x_smem, STAGES, GATED)  # fmt: skip
                a_even = _unpack_slot(words_smem, scales_smem, slot, a_layout)
                acc = warpgroup_mma(a_even, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
                a_odd = warpgroup_mma_wait(1, deps=(a_odd,))  # the step before done
                slot = _ready(2 * pair_step + 1, num_steps, word_ptrs, word_up_ptrs, scale_ptrs,
                              scale_up_ptrs, x_ptrs, words_smem, words_up_smem, scales_smem,
                              scales_up_smem, x_smem, STAGES, GATED)  # fmt: skip
                a_odd = _unpack_slot(words_smem, scales_smem, slot, a_layout)
                acc = warpgroup_mma(a_odd, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
                a_even = warpgroup_mma_wait(1, deps=(a_even,))
            if num_steps % 2:
                slot = _ready(num_steps - 1, num_steps, word_ptrs, word_up_ptrs, scale_ptrs,
                              scale_up_ptrs, x_ptrs, words_smem, words_up_smem, scales_smem,
                              scales_up_smem, x_smem, STAGES, GATED)  # fmt: skip
                a_last = _unpack_slot(words_smem, scales_smem, slot, a_layout)
                acc = warpgroup_mma(a_last, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
                a_odd, a_last = warpgroup_mma_wait(0, deps=(a_odd, a_last))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            acc_up = acc  # not read
        async_copy.wait_group(0)

        _store_block(acc, acc_up, block, tile, out_ptr, pair_of_pos_ptr,
                     row_weight_ptr, N, gate_limit, stride_om, GATED, TOKEN_ROWS, HAS_ROW_WEIGHT,
                     STORE_KERNEL_ORDER)  # fmt: skip


def decode_tiles(n: int, k: int, block_m: int, gated: bool) -> dict:
    """The launch options (`num_warps`: 16 · num_warps weight rows per program; `stages`: ring
    slots) for an (N, K, block size, use). THE CHOICE, from `grouped_gemm_tiles.py --gluon` on
    an H100 (2026-12-07, docs/performance.md): decode blocks 4 warps; gate/up 4 slots at
    blocks of 32 rows (256 tokens: 0.478 ms against the Triton kernel's 0.534), 3 at blocks
    of 16; down 6 slots (256 tokens: 0.255 against 0.315 ms). Prefill blocks of 128 rows: 8
    warps, 4 slots, programs in groups of 8 blocks (`PREFILL_CANDIDATES`)."""
    if block_m == 128:  # prefill (`PREFILL_CANDIDATES`): 4 slots won both uses on the H100
        return {"num_warps": 8, "stages": 4, "group_blocks": 8}
    if gated:
        return {"num_warps": 4, "stages": 4 if block_m > 16 else 3}
    return {"num_warps": 4, "stages": 6}


# What `benchmarks/grouped_gemm_tiles.py --gluon` times and the `gpu` tests check. The
# `max_registers` 128 rows: four programs per SM instead of three, where the ring's shared
# memory allows (compiled here for sm90, Triton 3.6, 2026-12-07: gate/up at blocks of 32, 3
# slots: 51 KB, 20 spill stores, 517 SASS a loop against 435 uncapped at 4 slots; down at
# blocks of 32, 4 slots: 50 KB, 10 spill stores, 480 against 467; not yet run on a GPU).
CANDIDATES: tuple[dict, ...] = (
    tuple({"num_warps": warps, "stages": stages} for warps in (4, 8) for stages in (3, 4, 5, 6))
    + tuple({"num_warps": 4, "stages": stages, "early_up_words": True} for stages in (3, 4))
    + tuple({"num_warps": 4, "stages": stages, "max_registers": 128} for stages in (3, 4))
)


# Blocks of 128 rows (prefill): the wgmma's N of 128 tokens against each unpacked weight tile, so
# the tensor cores, not the unpack, bound a step. What fits sm90's registers and shared memory
# (local compile, 8 warps, 3 or 4 slots: 235-255 registers, no spills, 122-196 KB of shared
# memory). H100, 4,096 tokens (2026-12-07 third session): gate/up 2.71 / 2.55 ms at 3 / 4 slots
# against the Triton prefill kernel's 4.33; down 2.58 / 2.28 against 2.29. In groups of 4, 8, 16
# blocks (2026-12-07 fourth session): down 1.63 / 1.66 / 1.65 ms against 2.30 in the plain
# order (the x rows of a block stay in L2 while its 40 column tiles run), gate/up 2.64 in every
# order; `gpu_rank` prefill 458.8 -> 434.5 ms at groups of 8 and of 16.
PREFILL_CANDIDATES: tuple[dict, ...] = (
    {"num_warps": 8, "stages": 3},
    {"num_warps": 8, "stages": 4},
) + tuple({"num_warps": 8, "stages": 4, "group_blocks": group} for group in (4, 8, 16))


def runs_here(x: Tensor) -> bool:
    """Whether this kernel can run on x's device: Gluon present and a Hopper GPU (sm90)."""
    return AVAILABLE and on_sm90(x.device)


def launch_decode(
    x: Tensor,
    blocks: ExpertBlocks,
    weights: tuple[Tensor, Tensor],
    out: Tensor,
    gate_limit: float | None,
    row_weight: Tensor | None,
    *,
    num_warps: int = 4,
    stages: int = STAGES,
    early_up_words: bool = False,
    group_blocks: int = 0,
    max_registers: int = 0,
    out_kernel_order: bool = False,
) -> None:
    """`_decode_kernel` over `blocks`: x bf16 [rows, K] already in the kernel's K order (gate/up:
    token rows; down: position rows), weights (codes int8 [E, N_w, K/2], scales uint8
    [E, N_w, K/32]), out [positions or pairs, N] written at the block's rows. 16 · num_warps
    weight rows per program. early_up_words (gate/up): the up matrix's words are read from
    shared memory before the gate's unpack (a candidate, `CANDIDATES`). group_blocks: the
    programs run in groups of this many blocks, each group's column tiles together
    (`_grouped_program`); 0: all blocks of a column tile, then the next tile. max_registers:
    the compiler's cap per thread (0: none; a candidate, `CANDIDATES`).

    Raises:
        ValueError: a shape this kernel does not take (K not a multiple of 128, blocks of other
            than 16, 32, 64 or 128 rows, fewer than three ring slots).
    """
    codes, scales = weights
    k, n = x.shape[1], out.shape[1]
    if k % STEP_K or blocks.block_m not in (16, 32, 64, 128) or stages < 3:
        raise ValueError(f"K = {k}, blocks of {blocks.block_m}, {stages} stages: not this kernel")
    scale_starts = (scales.data_ptr(), scales.stride(0), scales.stride(1))
    code_starts = (codes.data_ptr(), codes.stride(0), codes.stride(1))
    if any(start % 4 for start in scale_starts) or any(start % 16 for start in code_starts):
        raise ValueError("weight rows must start on 4-byte scale and 16-byte code boundaries")
    if group_blocks < 0:
        raise ValueError(f"group_blocks = {group_blocks}: not a group size")
    if max_registers and not 24 <= max_registers <= 255:
        raise ValueError(f"max_registers = {max_registers}: not a register cap")
    block_n = 16 * num_warps
    num_blocks = blocks.block_expert.numel()
    grid = (num_blocks, -(-n // block_n))
    if group_blocks:
        grid = (grid[0] * grid[1],)
    _decode_kernel[grid](
        x,
        codes.view(torch.int32),
        scales.view(torch.uint8),
        out,
        blocks.pair_of_pos,
        blocks.block_expert,
        row_weight if row_weight is not None else x,
        n,
        k,
        num_blocks,
        float(gate_limit or 0.0),
        x.stride(0),
        codes.stride(0),
        codes.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        TOP_K=blocks.top_k,
        GATED=gate_limit is not None,
        TOKEN_ROWS=gate_limit is not None,
        HAS_ROW_WEIGHT=row_weight is not None,
        BLOCK_M=blocks.block_m,
        STAGES=stages,
        STORE_KERNEL_ORDER=out_kernel_order,
        EARLY_UP_WORDS=early_up_words,
        GROUP_BLOCKS=group_blocks,
        num_warps=num_warps,
        **({"maxnreg": max_registers} if max_registers else {}),
    )
