"""Mixture of experts of one layer (`model.md` §3.8): sqrt-softplus routing, clamped SwiGLU.

Routed experts hold their weights either dequantised (`nn.Linear` in the model dtype) or as
stored in the checkpoint (`MXFP4Linear`: e2m1 codes + e8m0 scales, a quarter of the bf16 bytes),
which is what lets the full-width model fit one GPU; the shared expert is always dense.

Two paths compute the routed experts:

    reference (any device)   sort the (token, slot) pairs by expert, one `Expert` call per
                             expert that has rows (reads the per-expert counts on the host)
    grouped (CUDA, bf16,     `MoE.pack_experts` stacks the MXFP4 storage; two launches of
    packed MXFP4 experts)    `kernels.grouped_mxfp4_gemm` (gate/up + SwiGLU, down) and a sum
                             over the top-k slots; no host sync

Expert parallelism (`scaleout.md` §2.2, built with `expert_parallel`): the layer holds only its
rank's routed experts (`LocalExperts`, registered under their global ids = checkpoint names),
routes over all experts, ships tokens with `engine.distributed.dispatch`, runs its local experts
on what it received (`run_local_experts`) and combines back. The received rows take the same two
paths: the reference loop over the valid (row, local expert) pairs, or — where the grouped
kernel runs — the rows' local ids [R, k] as the kernel's routing, −1 (served elsewhere, or a
padding row) skipped by `align_to_experts` on the device; the same two launches, no host read.
The two local paths above are untouched when `expert_parallel` is None.

Batch-invariant mode (`Numerics.moe_batch_invariant`): routed experts compute every row alone
(`Expert.row_invariant`: a row's result cannot depend on which rows share the call) and the EP
combine adds a token's expert outputs in ascending expert id — the reference loop's order — so
the output does not depend on where experts live (bitwise equal to one process). The grouped
kernel's fixed tiles are row-invariant too, and `sum_by_expert_id` adds its slots in that order, so
on CUDA one process and any EP size agree bitwise as well.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.distributed.dispatch import Dispatcher, RecvBatch
from engine.distributed.dispatch.base import sum_by_expert_id
from engine.models.deepseek_v41.dense import Linear, dense_matmul, fp32_product
from engine.models.deepseek_v41.primitives import clamped_swiglu, sqrtsoftplus_route
from engine.models.deepseek_v41.weight_formats import MXFP4_BLOCK, mxfp4_dequantize
from kernels import interpreting, runs_kernels


class MXFP4Linear(nn.Module):
    """`y = x · Wᵀ` with W stored as MXFP4 along the input dim (checkpoint layout, `model.md`):
    `weight` int8 [out, in/2] (byte c: code of column 2c | code of column 2c+1 << 4) and
    `scale` float8_e8m0fnu [out, in/32].

    Reference path: W is dequantised to the activation dtype for each call (exactly the values
    the dense path holds); a fused kernel replaces it on the GPU.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        if in_features % MXFP4_BLOCK:
            raise ValueError(f"in_features must be a multiple of {MXFP4_BLOCK}, got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.batch_invariant = False  # see `Numerics.batch_invariant`
        packed = torch.zeros(out_features, in_features // 2, dtype=torch.int8)
        self.register_buffer("weight", packed)
        self.register_buffer(
            "scale",
            torch.zeros(out_features, in_features // MXFP4_BLOCK, dtype=torch.float8_e8m0fnu),
        )

    def forward(self, x: Tensor) -> Tensor:
        weight = mxfp4_dequantize(self.weight, self.scale, dtype=x.dtype)
        return dense_matmul(x, weight, self.batch_invariant)


class Expert(nn.Module):
    """`w2 · (silu(min(w1·x, L)) ⊙ clamp(w3·x, −L, L))`; names match `ffn.experts.{e}.w{1,2,3}`.

    quantized: hold the three projections as `MXFP4Linear` (routed experts only).
    """

    def __init__(
        self, dim: int, inter: int, limit: float, dtype: torch.dtype, quantized: bool = False
    ) -> None:
        super().__init__()
        self.limit = limit
        self.row_invariant = False  # see `Numerics.moe_batch_invariant`
        self.batch_invariant = False  # the SwiGLU's; see `Numerics.batch_invariant`
        if quantized:
            self.w1 = MXFP4Linear(dim, inter)
            self.w3 = MXFP4Linear(dim, inter)
            self.w2 = MXFP4Linear(inter, dim)
        else:
            self.w1 = Linear(dim, inter, dtype)
            self.w3 = Linear(dim, inter, dtype)
            self.w2 = Linear(inter, dim, dtype)

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """`weight` [T, 1], when given, scales the activation before the down projection."""
        if self.row_invariant and x.shape[0] > 1:
            rows = [
                self._forward(x[i : i + 1], None if weight is None else weight[i : i + 1])
                for i in range(x.shape[0])
            ]
            return torch.cat(rows)
        return self._forward(x, weight)

    def pack_gate_up(self) -> None:
        """Stack the dense w1 and w3 into one [2I, D] buffer (`w13_weight`, non-persistent);
        both weights become views of it, so memory does not grow. Then the kernel path runs
        gate and up as one GEMM and the SwiGLU as one launch (`kernels.clamped_swiglu`).

        NOTE: call it once the model is on its device (as `MoE.pack_experts`)."""
        if not (type(self.w1) is Linear and type(self.w3) is Linear):
            return  # MXFP4 (routed: the grouped kernel's layout) or FP8 dense linears
        packed = torch.cat((self.w1.weight.detach(), self.w3.weight.detach()))
        self.register_buffer("w13_weight", packed, persistent=False)
        inter = self.w1.weight.shape[0]
        self.w1.weight = nn.Parameter(packed[:inter], requires_grad=False)
        self.w3.weight = nn.Parameter(packed[inter:], requires_grad=False)

    def _forward(self, x: Tensor, weight: Tensor | None) -> Tensor:
        if hasattr(self, "w13_weight") and runs_kernels(x) and not self.batch_invariant:
            from kernels.clamped_swiglu import clamped_swiglu as swiglu_kernel

            act = swiglu_kernel(dense_matmul(x, self.w13_weight), self.limit)
        else:
            act = clamped_swiglu(self.w1(x), self.w3(x), self.limit, self.batch_invariant)
        if weight is not None:
            act = (act.float() * weight).to(act.dtype)
        return self.w2(act)


class Gate(nn.Module):
    def __init__(self, dim: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))


class LocalExperts(nn.Module):
    """The routed experts one EP rank holds, registered under their global ids (so parameter
    names stay `experts.{global id}.w1.weight`); indexed and iterated by local id."""

    def __init__(self, experts: list[Expert], first: int) -> None:
        super().__init__()
        for offset, expert in enumerate(experts):
            self.add_module(str(first + offset), expert)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, local_id: int) -> Expert:
        return list(self._modules.values())[local_id]


class MoE(nn.Module):
    """Routed experts (top-k of `num_experts`) plus one always-on shared expert.

    dispatcher: expert parallelism — hold only `dispatcher.placement`'s experts and exchange
    tokens through it (see the module docstring); None keeps every expert local.
    """

    def __init__(
        self,
        dim: int,
        inter: int,
        num_experts: int,
        top_k: int,
        route_scale: float,
        limit: float,
        dtype: torch.dtype,
        quantized_experts: bool = False,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.route_scale = route_scale
        self.weight_before_down = False  # see `Numerics.moe_weight_before_down`
        # `Numerics.moe_batch_invariant` or `batch_invariant`: the EP combine's fixed order, a
        # fixed-order gate matmul and the grouped kernel's fixed tiles.
        self.batch_invariant = False
        self.dispatcher = dispatcher
        self.gate = Gate(dim, num_experts, dtype)
        self.shared_experts = Expert(dim, inter, limit, dtype)
        if dispatcher is None:
            self.experts = nn.ModuleList(
                Expert(dim, inter, limit, dtype, quantized_experts) for _ in range(num_experts)
            )
        else:
            placement = dispatcher.placement
            if placement.num_experts != num_experts:
                raise ValueError(
                    f"the dispatcher places {placement.num_experts} experts, the layer has "
                    f"{num_experts}"
                )
            local = [
                Expert(dim, inter, limit, dtype, quantized_experts) for _ in placement.local_experts
            ]
            self.experts = LocalExperts(local, placement.first_expert)

    def pack_experts(self) -> None:
        """Stack the MXFP4 routed experts into the grouped kernel's layout (non-persistent
        buffers `w13_codes` [E, 2I, D/2], `w13_scales`, `w2_codes` [E, D, I/2], `w2_scales`);
        each expert's buffers become views of them, so memory does not grow. The shared
        expert's dense gate and up are stacked likewise (`Expert.pack_gate_up`).

        NOTE: call it once the model is on its device: `.to()` copies every buffer separately,
        after which the stacks and the experts hold equal values in twice the memory.
        """
        from kernels.grouped_mxfp4_gemm import decode_tiles_exact

        first = self.experts[0]
        if not isinstance(first.w1, MXFP4Linear):
            raise ValueError("pack_experts needs MXFP4 routed experts (quantized_experts=True)")
        for name, parts in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            for field, suffix in (("weight", "codes"), ("scale", "scales")):
                stacked = torch.stack(
                    [
                        torch.cat([getattr(getattr(expert, part), field) for part in parts])
                        for expert in self.experts
                    ]
                )
                self.register_buffer(f"{name}_{suffix}", stacked, persistent=False)
                for index, expert in enumerate(self.experts):
                    lo = 0
                    for part in parts:
                        linear = getattr(expert, part)
                        rows = getattr(linear, field).shape[0]
                        setattr(linear, field, stacked[index, lo : lo + rows])
                        lo += rows
        self.decode_tiles_exact = all(
            decode_tiles_exact(scales) for scales in (self.w13_scales, self.w2_scales)
        )
        self.shared_experts.pack_gate_up()

    def _use_grouped_kernel(self, x: Tensor) -> bool:
        """bf16 activations, packed MXFP4 experts, on CUDA (or in Triton's CPU interpreter,
        where the tests run the kernel's logic)."""
        return runs_kernels(x) and x.dtype == torch.bfloat16 and hasattr(self, "w13_codes")

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(expert ids [T, k], fp32 weights [T, k]); gate logits are computed in fp32."""
        logits = fp32_product(x, self.gate.weight, self.batch_invariant)
        return sqrtsoftplus_route(
            logits, self.gate.bias, self.top_k, self.route_scale, self.batch_invariant
        )

    def reads_x_in_kernel_order(self, x: Tensor) -> bool:
        """Whether `forward` of token rows like x ([T, D]: the same count, dtype and device)
        reads a copy of them in the grouped GEMM's K order (`x_kernel_order`) rather than
        reordering one itself: the gate/up launch runs the decode tiles."""
        if self.dispatcher is not None or self.batch_invariant or not self._use_grouped_kernel(x):
            return False
        from kernels.grouped_mxfp4_gemm import reads_kernel_order

        block_m = self._block_m(x.shape[0] * self.top_k)
        return reads_kernel_order(x.shape[1], block_m, exact_unpack=self._decode_tiles(), x=x)

    def forward(
        self, x: Tensor, x_kernel_order: Tensor | None = None, unreduced: bool = False
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """x [T, D] → [T, D]. x_kernel_order: x with each 128 columns in the grouped GEMM's K
        order, where `reads_x_in_kernel_order(x)` (the gate/up launch reads it as it is).

        unreduced: return (y, slots) instead: on the grouped kernels' one-rank path the shared
        experts' output [T, D] and the routed slots fp32 [T, k, D] (weighted), which
        `moe_combine` would add and the caller's own launch adds as it does
        (`mhc_post(slots=)`); elsewhere (the output, None)."""
        ids, weights = self.route(x)
        if self.dispatcher is None and self._use_grouped_kernel(x) and not self.batch_invariant:
            shared = self.shared_experts(x)
            slots = self._routed_slots(x, ids, weights, x_kernel_order)
            if unreduced:
                return shared, slots
            from kernels.moe_combine import moe_combine

            return moe_combine(shared, slots)  # the slots in slot order, the shared output
        out = self._combined(x, ids, weights)
        return (out, None) if unreduced else out

    def _combined(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        out = self.shared_experts(x).float()
        if self.dispatcher is not None:
            routed = self._routed_expert_parallel(x, ids, weights)
        elif self._use_grouped_kernel(x):
            routed = sum_by_expert_id(self._routed_slots(x, ids, weights), ids)
        else:
            routed = self._routed_reference(x, ids, weights)
        return (out + routed).to(x.dtype)

    def _routed_reference(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k
        routed = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        lo = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = token_of[lo : lo + count]
                w = weights.flatten()[order[lo : lo + count], None]
                if self.weight_before_down:
                    y = expert(x[rows], w).float()
                else:
                    y = expert(x[rows]).float() * w
                routed.index_add_(0, rows, y)
            lo += count
        return routed

    def _routed_expert_parallel(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """Dispatch, run the local experts, combine (a collective over the EP group)."""
        recv = self.dispatcher.dispatch(x, ids, weights)
        return self.dispatcher.combine(self.run_local_experts(recv), recv, self.batch_invariant)

    def run_local_experts(self, recv: RecvBatch) -> Tensor:
        """fp32 weighted outputs of the received pairs in slot layout [R, k, D] (zero at slots
        served elsewhere), as `combine` takes them: the grouped kernel when
        `_use_grouped_kernel`, else one `Expert` call per local expert that has rows (reads the
        pairs and the per-expert counts on the host)."""
        if self._use_grouped_kernel(recv.x):
            return self._local_grouped(recv)
        row, expert_id, weight = recv.pairs()
        order = torch.argsort(expert_id, stable=True)
        counts = torch.bincount(expert_id, minlength=len(self.experts)).tolist()
        out = torch.zeros(len(row), recv.x.shape[1], dtype=torch.float32, device=recv.x.device)
        lo = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                pairs = order[lo : lo + count]
                rows, w = recv.x[row[pairs]], weight[pairs, None]
                if self.weight_before_down:
                    out[pairs] = expert(rows, w).float()
                else:
                    out[pairs] = expert(rows).float() * w
            lo += count
        return recv.slot_outputs(out)

    def _local_grouped(self, recv: RecvBatch) -> Tensor:
        """The received rows as a routing over the local experts: `recv.local_ids` [R, k] is
        the grouped kernel's [T, top_k] with −1 at slots it skips, so the gate/up GEMM reads
        row r for slot (r, j) and the down GEMM writes it at r · k + j: no gather, no host
        read. Block size from R (a received row carries one local pair or more)."""
        from kernels.grouped_mxfp4_gemm import align_to_experts

        num_rows, k = recv.local_ids.shape
        dim = recv.x.shape[1]
        if num_rows == 0:  # a rank nobody sent anything to still joins the combine
            return torch.zeros(0, k, dim, dtype=torch.float32, device=recv.x.device)
        blocks = align_to_experts(recv.local_ids, len(self.experts), self._block_m(num_rows))
        per_slot = self._grouped_pairs(recv.x.contiguous(), blocks, recv.weights.flatten())
        valid = (recv.local_ids >= 0).flatten()[:, None]
        return torch.where(valid, per_slot, 0.0).view(num_rows, k, dim)  # skipped: unwritten

    def _routed_slots(
        self, x: Tensor, ids: Tensor, weights: Tensor, x_kernel_order: Tensor | None = None
    ) -> Tensor:
        """The grouped kernels' weighted outputs per (token, slot): fp32 [T, k, D]. (Batch-
        invariant mode adds them by expert id, `sum_by_expert_id`: the EP ordered combine's
        order.) x_kernel_order: as `forward`'s."""
        from kernels.grouped_mxfp4_gemm import align_to_experts

        num_tokens = x.shape[0]
        if num_tokens == 0:
            return torch.zeros(0, self.top_k, x.shape[1], dtype=torch.float32, device=x.device)
        blocks = align_to_experts(ids, len(self.experts), self._block_m(num_tokens * self.top_k))
        per_slot = self._grouped_pairs(x.contiguous(), blocks, weights.flatten(), x_kernel_order)
        return per_slot.view(num_tokens, self.top_k, -1)

    def _block_m(self, num_pairs: int) -> int:
        if self.batch_invariant:  # one tile shape for every step: a row never sees M
            return FIXED_BLOCK_M
        return _block_m(num_pairs, len(self.experts), self._decode_tiles())

    def _decode_tiles(self) -> bool:
        """Whether the decode tiles may run: exact for these scales, and not in Triton's CPU
        interpreter (their inline PTX has no interpreter)."""
        return self.decode_tiles_exact and not interpreting()

    def _grouped_pairs(
        self, x: Tensor, blocks, pair_weight: Tensor, x_kernel_order: Tensor | None = None
    ) -> Tensor:
        """fp32 weighted outputs [T · top_k, D] of the routing `blocks` (token rows `x`):
        gate/up + clamped SwiGLU, then down, each one grouped-kernel launch. x_kernel_order:
        x in the kernel's K order, read instead where the gate/up launch reads it so."""
        from kernels.grouped_mxfp4_gemm import grouped_mxfp4_gemm, reads_kernel_order

        pair_weight = pair_weight.float().contiguous()
        launch = {"fixed_tiles": self.batch_invariant, "exact_unpack": self._decode_tiles(), "x": x}
        ordered_x = x_kernel_order is not None and reads_kernel_order(
            x.shape[1], blocks.block_m, **launch
        )
        # The SwiGLU rows go in the order the down GEMM reads them, where it reads them so.
        inter = self.w2_codes.shape[-1] * 2
        order = reads_kernel_order(inter, blocks.block_m, **launch)
        act = grouped_mxfp4_gemm(
            x_kernel_order if ordered_x else x,
            blocks,
            self.w13_codes,
            self.w13_scales,
            gate_limit=self.experts[0].limit,
            row_weight=pair_weight if self.weight_before_down else None,
            fixed_tiles=self.batch_invariant,
            register_unpack=self._decode_tiles(),  # exact where the decode tiles are
            x_kernel_order=ordered_x,
            out_kernel_order=order,
        )
        return grouped_mxfp4_gemm(
            act,
            blocks,
            self.w2_codes,
            self.w2_scales,
            row_weight=None if self.weight_before_down else pair_weight,
            out_dtype=torch.float32,
            fixed_tiles=self.batch_invariant,
            register_unpack=self._decode_tiles(),
            x_kernel_order=order,
        )


FIXED_BLOCK_M = 64  # batch-invariant mode: the prefill kernel's tiles at every step


def _block_m(num_pairs: int, num_experts: int, decode_tiles: bool = True) -> int:
    """Rows per expert block: small blocks when few rows reach each expert (decode, up to 32 rows:
    the grouped kernel's weight-streaming tiles, unless `decode_tiles` is False: weights whose
    scales that kernel cannot unpack exactly), large ones for prefill (reuse of each
    dequantised weight tile)."""
    per_expert = num_pairs / num_experts
    for block_m in (16, 32, 64) if decode_tiles else (64,):
        if per_expert <= block_m:
            return block_m
    return 64 if per_expert <= 128 else 128
