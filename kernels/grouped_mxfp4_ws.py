"""The grouped MXFP4 GEMM on Hopper, warp-specialized: the product of
`grouped_mxfp4_gluon._decode_kernel` (outᵀ = W · xᵀ per expert block, the weights unpacked in
registers as the wgmma's A operand) with the loads moved off the computing warps, for prefill's
blocks of 128 rows and decode's of 16 to 64 (`tiles`).

What held the cp.async kernel at prefill (Nsight Compute, 2026-12-07, docs/performance.md "What
holds the prefill gate/up now"): one 8-warp program per SM, each step's 13 cp.async per thread
(lg throttle), the CTA barrier after them, and the unpack's latency chains left the tensor pipe
idle 45 % of the time. Here:

* one producer warp issues each step's TMA copies (the weight words of the gate and up rows,
  the block's 128 x rows) into a ring of STAGES slots; each slot's `ready` mbarrier counts the
  bytes in, its `empty` mbarrier is the consumers' release;
* the consumer warps (the default partition: two warpgroups at prefill, 128 weight rows; one
  at decode, 64 rows, three programs per SM) only wait for a slot, unpack the words into the
  wgmma's A registers (`grouped_mxfp4_gluon._unpack`) and multiply; the scales
  (four bytes a row a step) come by plain loads one step ahead, because a TMA copy needs 16-byte
  global strides and the down's scale rows are 72 bytes;
* TMA needs x as 2-D tiles: the down's x (the gate/up output at positions) is that already;
  the gate/up's x rows are the block's token rows, so the launcher gathers them into position
  order first (`grouped_mxfp4_gemm.rows_at_positions`: one launch that also writes the K order,
  in place of the K reordering copy the cp.async kernel's launcher makes; a producer gathering
  rows by `cp.async` with `cp.async.mbarrier.arrive` would avoid the copy, not built).

At decode the cp.async kernel's consumers also load: 13 `cp.async` a step and two CTA barriers
(Nsight Compute at 256 tokens, 2026-12-07: short scoreboard, wait, dispatch and barrier stalls
at three 4-warp programs per SM, 0.5 instructions issued per scheduler cycle). Here three
programs per SM keep the same twelve consumer warps, with only the unpack and the products.

The same bits as `grouped_mxfp4_gluon` (same unpack, same products in the same K order, same
epilogue): the `gpu` tests compare both with the torch reference
`grouped_mxfp4_gemm.grouped_mxfp4_gemm_reference` and with each other.

Contract (the launcher checks it, `runs`): blocks of 16, 32, 64 or 128 rows, K a multiple of
128, N a multiple of the program's weight rows (16 · num_warps), x in the kernel's K order with
16-byte aligned rows, codes and scales [E, N_w, ·] with each expert's rows contiguous (a TMA tile
is a 2-D box of the [E · N_w, K / 8] word view), 16-byte aligned code rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import grouped_mxfp4_gluon
from kernels.expert_alignment import ExpertBlocks

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 names the TMA copy `async_copy_global_to_shared`, later ones `async_load`
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    AVAILABLE = grouped_mxfp4_gluon.AVAILABLE and hasattr(gl, "warp_specialize")
except (ImportError, AttributeError):  # a Triton without (this) Gluon
    AVAILABLE = False

STEP_K = grouped_mxfp4_gluon.STEP_K
BLOCK_SIZES = (16, 32, 64, 128)  # token rows of a block: the wgmma's N
PRODUCER_REGISTERS = 24
# The producer warp comes on top of the consumers' `num_warps` as the first warp of one more
# warpgroup, so a program holds num_warps + 4 warps: `max_registers` is the launch's cap on each
# (168 with 8 consumer warps: one program per SM, the consumers re-allocated to 240; 80 with 4:
# three per SM, the consumers at 136), the producer then gives its registers up.


def tiles(block_m: int, gated: bool) -> dict:
    """The launch options for a block size (`launch`'s keywords). Compiled for sm90 here (Triton
    3.6), no spills: prefill (blocks of 128) 8 consumer warps at 240 registers, 4 slots, 197 KB
    (gate/up) and 164 KB (down) of shared memory, programs in groups of 8 blocks; decode 4
    consumer warps at 136 registers, 4 slots (gate/up, 66 KB at blocks of 32) or 6 (down, 74
    KB), three programs per SM. Not yet run on a GPU."""
    if block_m == 128:
        return {"num_warps": 8, "stages": 4, "group_blocks": 8, "max_registers": 168}
    return {"num_warps": 4, "stages": 4 if gated else 6, "group_blocks": 0, "max_registers": 80}


# What the sweeps (`benchmarks/grouped_gemm_tiles.py --gluon`) and the `gpu` tests run.
PREFILL_CANDIDATES: tuple[dict, ...] = tuple(
    {"num_warps": 8, "stages": stages, "group_blocks": group, "max_registers": 168}
    for stages in (3, 4)
    for group in (0, 8)
)
DECODE_CANDIDATES: tuple[dict, ...] = tuple(
    {"num_warps": 4, "stages": stages, "group_blocks": 0, "max_registers": cap}
    for stages in (4, 6)
    for cap in (80, 128)
)


if AVAILABLE:
    _STEP_K = gl.constexpr(STEP_K)
    _PRODUCER_REGISTERS = gl.constexpr(PRODUCER_REGISTERS)
    _unpack = grouped_mxfp4_gluon._unpack
    _words_layout = grouped_mxfp4_gluon._words_layout
    _acc_layout = grouped_mxfp4_gluon._acc_layout
    _block_and_tile = grouped_mxfp4_gluon._block_and_tile
    _store_block = grouped_mxfp4_gluon._store_block

    @gluon.jit
    def _produce(codes_desc, x_desc, words_smem, words_up_smem, x_smem, ready, empty, code_row,
                 up_offset, x_row, num_steps, GATED: gl.constexpr):  # fmt: skip
        """The producer warp: step k's words (and the up's) and x tile into slot k % STAGES once
        the consumers released it, all counted on the slot's `ready` barrier."""
        STAGES: gl.constexpr = x_smem.shape[0]
        code_bytes: gl.constexpr = codes_desc.block_type.nbytes
        x_bytes: gl.constexpr = x_desc.block_type.nbytes
        for step in range(num_steps):
            slot = step % STAGES
            # a fresh barrier counts as having completed the phase before phase 0
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            if GATED:
                mbarrier.expect(bar, 2 * code_bytes + x_bytes)
            else:
                mbarrier.expect(bar, code_bytes + x_bytes)
            word_col = step * (_STEP_K // 8)
            _tma_load(codes_desc, [code_row, word_col], bar, words_smem.index(slot))
            if GATED:
                _tma_load(codes_desc, [code_row + up_offset, word_col], bar,
                          words_up_smem.index(slot))  # fmt: skip
            _tma_load(x_desc, [x_row, step * _STEP_K], bar, x_smem.index(slot))

    @gluon.jit
    def _slot_operand(words_smem, ready, step, scales, A_LAYOUT: gl.constexpr):
        """Wait for step `step`'s slot, then its words unpacked under `scales` (the A operand)."""
        STAGES: gl.constexpr = words_smem.shape[0]
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        words = words_smem.index(slot).load(_words_layout(gl.num_warps()))
        return _unpack(words, scales, A_LAYOUT)

    @gluon.jit
    def _release(empty, step, pred=True):
        """Hand step `step`'s slot back to the producer: its words were read (fenced against the
        slot's next TMA write) and every product that reads its x tile was waited for."""
        STAGES: gl.constexpr = empty.shape[0]
        fence_async_shared()
        mbarrier.arrive(empty.index((step + STAGES) % STAGES), pred=pred)  # step >= -1

    @gluon.jit
    def _scales_at(scale_ptrs, step, num_steps):
        return gl.load(scale_ptrs + gl.minimum(step, num_steps - 1))

    @gluon.jit
    def _consume_gated(words_smem, words_up_smem, x_smem, ready, empty, scale_ptrs, scale_up_ptrs,
                       num_steps):  # fmt: skip
        """The two consumer warpgroups of a gate/up program: per step, the gate's product runs
        while the up's words are unpacked, and the up's while the next step's gate words are;
        the scales of step k + 1 are in flight during step k. Returns (gate, up)."""
        STAGES: gl.constexpr = x_smem.shape[0]
        acc_layout: gl.constexpr = _acc_layout(gl.num_warps(), x_smem.shape[1])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        shape: gl.constexpr = [words_smem.shape[1], x_smem.shape[1]]
        a_shape: gl.constexpr = [words_smem.shape[1], _STEP_K]
        # loop-carried as the loop leaves them: the gate's product waited for, the up's in flight
        acc = gl.zeros(shape, gl.float32, acc_layout)
        acc_up = warpgroup_mma_init(gl.zeros(shape, gl.float32, acc_layout))
        a_up = gl.zeros(a_shape, gl.bfloat16, a_layout)
        scales = gl.load(scale_ptrs)
        scales_up = gl.load(scale_up_ptrs)
        for step in range(num_steps):
            scales_next = _scales_at(scale_ptrs, step + 1, num_steps)
            scales_up_next = _scales_at(scale_up_ptrs, step + 1, num_steps)
            x_tile = x_smem.index(step % STAGES).permute((1, 0))
            a = _slot_operand(words_smem, ready, step, scales, a_layout)
            acc = warpgroup_mma(a, x_tile, acc, is_async=True)
            words_up = words_up_smem.index(step % STAGES).load(_words_layout(gl.num_warps()))
            # the up of step - 1 done: its A registers and its slot's x are free
            acc_up, a_up = warpgroup_mma_wait(1, deps=(acc_up, a_up))
            a_up = _unpack(words_up, scales_up, a_layout)
            acc_up = warpgroup_mma(a_up, x_tile, acc_up, is_async=True)
            # released after the up's product is issued, not before: membar's barrier ahead of
            # the arrive then also orders the wgmma (one 256-thread barrier fewer a step)
            _release(empty, step - 1, step > 0)
            acc, a = warpgroup_mma_wait(1, deps=(acc, a))  # the gate of this step done
            scales = scales_next
            scales_up = scales_up_next
        return warpgroup_mma_wait(0, deps=(acc, acc_up))

    @gluon.jit
    def _consume_plain(words_smem, x_smem, ready, empty, scale_ptrs, num_steps):
        """The two consumer warpgroups of a down program: two steps per iteration, so that the
        A operand unpacked while the other step's product runs lives in other registers (a
        loop-carried copy would let the next unpack overwrite registers the tensor cores still
        read). Returns (product, product)."""
        STAGES: gl.constexpr = x_smem.shape[0]
        acc_layout: gl.constexpr = _acc_layout(gl.num_warps(), x_smem.shape[1])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        shape: gl.constexpr = [words_smem.shape[1], x_smem.shape[1]]
        a_shape: gl.constexpr = [words_smem.shape[1], _STEP_K]
        acc = warpgroup_mma_init(gl.zeros(shape, gl.float32, acc_layout))
        a_odd = gl.zeros(a_shape, gl.bfloat16, a_layout)
        scales = gl.load(scale_ptrs)
        for pair_step in range(num_steps // 2):
            even = 2 * pair_step
            scales_odd = _scales_at(scale_ptrs, even + 1, num_steps)
            a_even = _slot_operand(words_smem, ready, even, scales, a_layout)
            acc = warpgroup_mma(a_even, x_smem.index(even % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            a_odd = warpgroup_mma_wait(1, deps=(a_odd,))  # the step before done
            _release(empty, even - 1, even > 0)
            scales = _scales_at(scale_ptrs, even + 2, num_steps)
            a_odd = _slot_operand(words_smem, ready, even + 1, scales_odd, a_layout)
            acc = warpgroup_mma(a_odd, x_smem.index((even + 1) % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            a_even = warpgroup_mma_wait(1, deps=(a_even,))
            _release(empty, even)
        if num_steps % 2:
            last = num_steps - 1
            a_last = _slot_operand(words_smem, ready, last, scales, a_layout)
            acc = warpgroup_mma(a_last, x_smem.index(last % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            a_odd, a_last = warpgroup_mma_wait(0, deps=(a_odd, a_last))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        return acc, acc

    @gluon.jit(do_not_specialize=["num_blocks"])  # step-varying: one variant
    def _ws_kernel(
        x_desc,
        codes_desc,
        scales_ptr,
        out_ptr,
        pair_of_pos_ptr,
        block_expert_ptr,
        row_weight_ptr,
        N,
        K,
        num_blocks,
        gate_limit,
        stride_sn,
        stride_se,
        stride_om,
        GATED: gl.constexpr,
        HAS_ROW_WEIGHT: gl.constexpr,
        STAGES: gl.constexpr,
        STORE_KERNEL_ORDER: gl.constexpr,
        GROUP_BLOCKS: gl.constexpr,
    ):
        BLOCK_ROWS: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_W: gl.constexpr = codes_desc.block_type.shape[0]
        block, tile = _block_and_tile(num_blocks, gl.cdiv(N, BLOCK_W), GROUP_BLOCKS)
        expert = gl.load(block_expert_ptr + block)
        if expert < 0:
            return
        num_steps = K // _STEP_K
        n_weight = 2 * N if GATED else N
        code_row = expert * n_weight + tile * BLOCK_W

        # the consumers' scale words: rows r of their words layout, one int32 (four e8m0
        # bytes) a step
        rows_layout: gl.constexpr = gl.SliceLayout(1, _words_layout(gl.num_warps()))
        offs_n = tile * BLOCK_W + gl.arange(0, BLOCK_W, layout=rows_layout)
        scale_words_ptr = (scales_ptr + expert.to(gl.int64) * stride_se).to(
            gl.pointer_type(gl.int32)
        )
        scale_ptrs = scale_words_ptr + offs_n * (stride_sn // 4)
        scale_up_ptrs = scale_ptrs + N * (stride_sn // 4)

        words_smem = gl.allocate_shared_memory(
            gl.int32, [STAGES] + codes_desc.block_type.shape, codes_desc.layout
        )
        if GATED:
            words_up_smem = gl.allocate_shared_memory(
                gl.int32, [STAGES] + codes_desc.block_type.shape, codes_desc.layout
            )
        else:
            words_up_smem = words_smem
        x_smem = gl.allocate_shared_memory(
            gl.bfloat16, [STAGES] + x_desc.block_type.shape, x_desc.layout
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            mbarrier.init(ready.index(slot), count=1)
            mbarrier.init(empty.index(slot), count=1)

        # worker partitions take the same arguments; the default partition is the consumers
        produce_args = (codes_desc, x_desc, words_smem, words_up_smem, x_smem, ready, empty,
                        code_row, N, block * BLOCK_ROWS, num_steps, GATED)  # fmt: skip
        if GATED:
            consume_args = (words_smem, words_up_smem, x_smem, ready, empty, scale_ptrs,
                            scale_up_ptrs, num_steps)  # fmt: skip
            acc, acc_up = gl.warp_specialize(
                [
                    (_consume_gated, consume_args),
                    (_produce, produce_args),
                ],
                [1],
                [_PRODUCER_REGISTERS],
            )
        else:
            acc, acc_up = gl.warp_specialize(
                [
                    (_consume_plain, (words_smem, x_smem, ready, empty, scale_ptrs, num_steps)),
                    (_produce, produce_args),
                ],
                [1],
                [_PRODUCER_REGISTERS],
            )
        _store_block(acc, acc_up, block, tile, out_ptr, pair_of_pos_ptr, row_weight_ptr, N,
                     gate_limit, stride_om, GATED, GATED, HAS_ROW_WEIGHT,
                     STORE_KERNEL_ORDER)  # fmt: skip


def runs(x: Tensor, blocks: ExpertBlocks, codes: Tensor, n: int, num_warps: int = 8) -> bool:
    """Whether this kernel takes the launch (the module docstring's contract) with `num_warps`
    consumer warps: Gluon with warp specialization on an sm90 device, x's rows 16-byte aligned,
    blocks of `BLOCK_SIZES` rows, K a multiple of 128 and N of the program's 16 · num_warps
    weight rows, each expert's code rows contiguous and 16-byte aligned."""
    k = x.shape[1]
    return (
        AVAILABLE
        and grouped_mxfp4_gluon.runs_here(x)
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and blocks.block_m in BLOCK_SIZES
        and num_warps in (4, 8)
        and k % STEP_K == 0
        and n % (16 * num_warps) == 0
        and codes.stride(0) == codes.shape[1] * codes.stride(1)
        and codes.stride(2) == 1
        and codes.data_ptr() % 16 == 0
        and codes.stride(1) % 16 == 0
    )


def launch(
    x: Tensor,
    blocks: ExpertBlocks,
    weights: tuple[Tensor, Tensor],
    out: Tensor,
    gate_limit: float | None,
    row_weight: Tensor | None,
    *,
    num_warps: int = 8,
    stages: int = 4,
    group_blocks: int = 8,
    max_registers: int = 168,
    out_kernel_order: bool = False,
) -> None:
    """`_ws_kernel` over `blocks`: x bf16 [num_positions, K] at the block positions (gate/up:
    `grouped_mxfp4_gemm.rows_at_positions` of the token rows) in the kernel's K order, weights
    (codes int8 [E, N_w, K/2], scales uint8 [E, N_w, K/32]), out [positions or pairs, N]
    written at the block's rows. num_warps consumer warps (16 · num_warps weight rows a
    program), `stages` ring slots, programs in groups of `group_blocks` blocks (0: a two-axis
    grid), the launch's register cap `max_registers` (`tiles` gives all four by block size).
    `runs` says whether the launch is this kernel's.

    Raises:
        ValueError: a shape this kernel does not take (`runs`), fewer than two ring slots, or a
            register cap the consumers cannot run under.
    """
    codes, scales = weights
    n = out.shape[1]
    if not runs(x, blocks, codes, n, num_warps) or x.shape[0] != blocks.num_positions:
        raise ValueError(f"x {tuple(x.shape)}, blocks of {blocks.block_m}, N {n}, "
                         f"{num_warps} warps: not this kernel")  # fmt: skip
    if stages < 2 or not 64 <= max_registers <= 255 or group_blocks < 0:
        raise ValueError(f"{stages} stages, register cap {max_registers}, groups of "
                         f"{group_blocks}: not launch options of this kernel")  # fmt: skip
    if scales.stride(1) % 4 or scales.stride(0) % 4 or scales.data_ptr() % 4:
        raise ValueError("scale rows must start on 4-byte boundaries")
    block_n = 16 * num_warps
    words = codes.view(torch.int32).view(-1, codes.shape[2] // 4)
    words_shared = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    codes_desc = TensorDescriptor.from_tensor(words, [block_n, STEP_K // 8], words_shared)
    x_shared = gl.NVMMASharedLayout.get_default_for([blocks.block_m, STEP_K], gl.bfloat16)
    x_desc = TensorDescriptor.from_tensor(x, [blocks.block_m, STEP_K], x_shared)
    num_blocks = blocks.block_expert.numel()
    grid = (num_blocks, n // block_n)
    if group_blocks:
        grid = (grid[0] * grid[1],)
    _ws_kernel[grid](
        x_desc,
        codes_desc,
        scales.view(torch.uint8),
        out,
        blocks.pair_of_pos,
        blocks.block_expert,
        row_weight if row_weight is not None else out,
        n,
        x.shape[1],
        num_blocks,
        float(gate_limit or 0.0),
        scales.stride(1),
        scales.stride(0),
        out.stride(0),
        GATED=gate_limit is not None,
        HAS_ROW_WEIGHT=row_weight is not None,
        STAGES=stages,
        STORE_KERNEL_ORDER=out_kernel_order,
        GROUP_BLOCKS=group_blocks,
        num_warps=num_warps,
        maxnreg=max_registers,
    )
