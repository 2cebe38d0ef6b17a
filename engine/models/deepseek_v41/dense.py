"""The model's dense linears: FP8 as stored (`Numerics.dense_fp8`) and the batch-invariant
matmul (`Numerics.batch_invariant`).

FP8 dense linears
-----------------

Every dense linear of the checkpoint is FP8 with one ue8m0 scale per `fp8_block_size`² tile
(`model.md` §5.3): the attention projections (`wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`), the
indexer's `wq_b`, the shared experts, Engram's `wkv` and DSpark's `main_proj`. By default the
loader dequantizes them to the compute dtype and `nn.Linear` runs them. With `dense_fp8` they
become `FP8BlockLinear`: `weight` float8_e4m3fn [out, in] and `scale` float8_e8m0fnu (the stored
names and bytes), activations quantized to FP8 per (row, block of input columns) and multiplied
on FP8 tensor cores by `kernels.fp8_block_gemm` (fp32 accumulation, output in x's dtype).
With `dense_fp8` and not `dense_fp8_activations` (W8A16) the activations stay bf16: decode-sized
products stream the FP8 bytes through `kernels.fp8_weight_gemm`, which decodes each weight in
registers to the bf16 value the default loader stores, larger ones dequantize the weight per
call and take the bf16 GEMM (`FP8BlockLinear._bf16_activations`). Its products are the
default path's; only the order of the fp32 sums differs. It halves the dense weights' memory
(~6.5 GB of an EP8 rank's 13 GB); it is not faster: the kernel streams half the bytes at half
cuBLAS's rate (H100: decode 16 rows 28.1 vs 28.0 ms per step, 256 rows 65.3 vs 57.0 ms, where
each call dequantizes; docs/performance.md).

On the CPU (tests, the end-to-end error in docs/model.md) the kernel's numerics run as its
torch reference: the same activation codes and scales, both operands dequantized, a float32
product. The engine does not offer that for serving (`EngineConfig.dense_gemm`).

`grouped_linear` is the one call site that is not `module(x)`: `wo_a`'s 8 groups.

Batch invariance (`Numerics.batch_invariant`)
---------------------------------------------

Every dense matmul that is not FP8 goes through `dense_matmul` (`Linear` is the model's
`nn.Linear`, calling it; `grouped_linear` too), so the mode lives in one place.

Default: `F.linear`. BLAS picks a kernel per shape, so a row's result can change with the
number of rows M it is computed with — measured with MKL on the CPU: M = 1 runs as a GEMV,
M = 2..6 and M ≥ 7 round differently again, so a request decoding alone gets other logits
than the same request decoding beside 64 others.

Batch-invariant: a row's result is a function of that row and the weight only (`row_sum`
gives sums over the last dim the same property).

    CUDA    `kernels.invariant_matmul`: constant tiles, constant BLOCK_K, no split-K
    CPU     rows in tiles of `ROW_TILE`, each copied into one fresh tile buffer (the last one
            zero-padded) and multiplied by one BLAS call of the same shape, strides and
            alignment every time: the call that computes a row never depends on M

NOTE: the CPU path relies on a BLAS call being a fixed function of its shape, strides and
operand alignment (never of the other rows' values), which MKL's GEMM is; the engine tests
(`tests/engine/test_batch_invariance.py`) check the whole forward bitwise.

fp32 products of bf16 weights (`Linear.forward_fp32`)
------------------------------------------------------

Logits, the attention's `wkv`/`wgate`, the indexer's weights and DSpark's heads are computed as
f32(x) · f32(W)ᵀ. On the kernel path (CUDA: `fp32_on_tensor_cores`) with bf16 weights (outside
batch-invariant mode) that is one bf16 tensor-core GEMM with fp32 output over x split exactly
into three bf16 parts stacked as rows (x = hi + mid + lo; bf16 × bf16 products are exact in
fp32), then the three partial products added, in three launches (`fp32_times_bf16`: the
split `kernels.bf16_split`, the GEMM, the sum `kernels.parts_sum`): no fp32 copy of W per call
(the lm head's was 2.6 GB per step at the released widths) and no fp32 CUDA-core GEMM. The split
is exact and its three fp32 adds round by ≤ u·|y| each, so the error is the GEMM's own: the
tensor cores' fp32 accumulator truncates (rounds toward zero) once per step of k = 16 products
instead of rounding to nearest per product, an error biased toward zero that grows with K:
measured on the H200 at K = 5120, 1.6e-6..5.4e-6 relative against 2.4e-7..5.2e-7 for the fp32
CUDA-core GEMM, bounded by ~(K/16)·u (2e-5; `tests/models/test_dense.py`). Far below the bf16
activations' own 4e-3 that feed these products in a bf16 model; exact mode (fp32 weights)
does not take this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.deepseek_v41.config import ceil_div
from kernels import fp8_block_gemm as fp8_gemm
from kernels import runs_kernels
from kernels.bf16_split import bf16_split, bf16_split_reference
from kernels.fp8_weight_gemm import dequantize_fp8_weight, fp8_weight_gemm
from kernels.invariant_matmul import invariant_matmul
from kernels.parts_sum import parts_sum, parts_sum_reference

ROW_TILE = 16
# W8A16 (`FP8BlockLinear` without activation quantization): products of up to this many rows
# stream the FP8 weights through `kernels.fp8_weight_gemm` (a decode step's); more rows take
# the weight dequantized to bf16 and the bf16 GEMM. Measured (H100, docs/performance.md): the
# kernel ties cuBLAS's bf16 GEMM at 16–64 rows and loses at 256, where dequantizing per call
# costs less.
W8A16_MAX_ROWS = 64


def dense_matmul(x: Tensor, weight: Tensor, batch_invariant: bool = False) -> Tensor:
    """`x · weightᵀ`: x [..., K], weight [N, K] (same dtype) → [..., N] in that dtype.

    batch_invariant: every output row is computed by the same fixed sequence of operations
    whatever the other rows are (see the module docstring); slower for few rows.
    """
    if not batch_invariant:
        return F.linear(x, weight)
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k).contiguous()
    tiled = invariant_matmul if runs_kernels(flat) else _row_tiled
    out = tiled(flat, weight.contiguous())
    return out.view(*lead, weight.shape[0])


def _row_tiled(x: Tensor, weight: Tensor) -> Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tile = torch.empty(ROW_TILE, k, dtype=x.dtype, device=x.device)
    tile_out = torch.empty(ROW_TILE, n, dtype=x.dtype, device=x.device)
    weight_t = weight.t()
    for lo in range(0, m, ROW_TILE):
        rows = min(ROW_TILE, m - lo)
        if rows < ROW_TILE:
            tile.zero_()
        tile[:rows] = x[lo : lo + rows]
        torch.mm(tile, weight_t, out=tile_out)
        out[lo : lo + rows] = tile_out[:rows]
    return out


def row_sum(x: Tensor, batch_invariant: bool = False) -> Tensor:
    """`x.sum(-1)`; batch_invariant: as `dense_matmul` against a row of ones, so each row's
    sum has one fixed order (torch's CUDA reductions choose their thread layout, hence their
    order, by the number of rows)."""
    if not batch_invariant:
        return x.sum(-1)
    ones = torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device)
    return dense_matmul(x, ones, True)[..., 0]


class Linear(nn.Linear):
    """`nn.Linear` without bias whose products go through `dense_matmul` (checkpoint names
    and state dicts are nn.Linear's). `batch_invariant` is set by the model from its
    `Numerics`."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.batch_invariant = False

    def forward(self, x: Tensor) -> Tensor:
        return dense_matmul(x, self.weight, self.batch_invariant)

    def forward_fp32(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """`f32(x) · f32(W)ᵀ · scale` (gates, scores and logits computed in fp32; module
        docstring)."""
        return fp32_product(x, self.weight, self.batch_invariant, scale)


def fp32_product(
    x: Tensor, weight: Tensor, batch_invariant: bool = False, scale: float = 1.0
) -> Tensor:
    """`f32(x) · f32(weight)ᵀ · scale`: x [..., K], weight [N, K] → fp32 [..., N]; on the
    tensor cores as `fp32_times_bf16` where `fp32_on_tensor_cores` (the scale applied in its
    last launch), else as an fp32 `dense_matmul` (then a product by the scale unless it is 1).
    Either way the scale is the Python float rounded to fp32, as torch's `tensor * scale`."""
    if fp32_on_tensor_cores(x, weight, batch_invariant):
        return fp32_times_bf16(x, weight, scale)
    y = dense_matmul(x.float(), weight.float(), batch_invariant)
    return y if scale == 1.0 else y * scale


def fp32_on_tensor_cores(x: Tensor, weight: Tensor, batch_invariant: bool = False) -> bool:
    """Whether `fp32_product(x, weight)` runs on the tensor cores (`fp32_times_bf16`): the
    kernel path (`runs_kernels`), a bf16 weight, outside batch-invariant mode, and a torch that
    runs bf16 GEMMs with fp32 output on x's device (CUDA's; the CPU build has none, so a run
    on the CPU, in Triton's interpreter or not, takes the fp32 product unless something
    provides that GEMM: `benchmarks/kernel_census.py` does, to count what a GPU launches)."""
    return (
        runs_kernels(x)
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == torch.bfloat16
        and not batch_invariant
        and bf16_mm_to_fp32_runs(x.device)
    )


def fp32_times_bf16(x: Tensor, weight: Tensor, scale: float = 1.0) -> Tensor:
    """fp32 or bf16 x [..., K] · bf16 weight [N, K]ᵀ · scale → fp32 [..., N] in three launches:
    x's three exact bf16 parts (`kernels.bf16_split`), one bf16 GEMM with fp32 output over them
    as rows (CUDA: `torch.mm(..., out_dtype=float32)`), the three partial products added in
    order and scaled (`kernels.parts_sum`). A bf16 x is its own only part: the GEMM alone
    (then the scale, unless it is 1). Bit for bit `fp32_times_bf16_reference`."""
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    if x.dtype == torch.bfloat16:
        return _bf16_times_bf16(x, weight, scale)
    parts = bf16_split(x).view(-1, k)
    partials = torch.mm(parts, weight.t(), out_dtype=torch.float32)
    return parts_sum(partials.view(3, *lead, n), scale)


def fp32_times_bf16_reference(x: Tensor, weight: Tensor, scale: float = 1.0) -> Tensor:
    """`fp32_times_bf16`'s torch form: the kernels' references around the same GEMM (~11
    launches)."""
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    if x.dtype == torch.bfloat16:
        return _bf16_times_bf16(x, weight, scale)
    parts = bf16_split_reference(x).view(-1, k)
    partials = torch.mm(parts, weight.t(), out_dtype=torch.float32)
    return parts_sum_reference(partials.view(3, *lead, n), scale)


def _bf16_times_bf16(x: Tensor, weight: Tensor, scale: float) -> Tensor:
    """bf16 x · bf16 weightᵀ · scale in fp32: one GEMM with fp32 output (the products exact),
    one product by the fp32-rounded scale unless it is 1."""
    lead, k = x.shape[:-1], x.shape[-1]
    y = torch.mm(x.reshape(-1, k), weight.t(), out_dtype=torch.float32)
    y = y.view(*lead, weight.shape[0])  # no −1: a step may carry no rows
    return y if scale == 1.0 else y * scale


def bmm_exact_bf16(a: Tensor, b: Tensor) -> Tensor:
    """fp32 a [B, M, K] · b [B, K, N] → fp32 [B, M, N] for operands whose values are exact in
    bf16 (FP4/FP8-decoded rows, bf16 rows): one bf16 tensor-core GEMM per batch entry, the
    products exact in fp32 (CUDA: `torch.bmm(..., out_dtype=float32)`)."""
    return torch.bmm(a.bfloat16(), b.bfloat16(), out_dtype=torch.float32)


_MM_TO_FP32: dict[torch.device, bool] = {}


def bf16_mm_to_fp32_runs(device: torch.device) -> bool:
    """Whether this torch runs bf16 GEMMs (`mm`, `bmm`) with fp32 output on `device` (tried once
    per device, with no host read, so a CUDA-graph warm-up may be the first call)."""
    if device not in _MM_TO_FP32:
        probe = torch.ones(2, 32, dtype=torch.bfloat16, device=device)
        try:
            runs = torch.mm(probe, probe.t(), out_dtype=torch.float32).dtype == torch.float32
            runs = runs and bmm_exact_bf16(probe[None], probe.t()[None]).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            runs = False
        _MM_TO_FP32[device] = runs
    return _MM_TO_FP32[device]


class FP8BlockLinear(nn.Module):
    """`y = x · Wᵀ` with W as the checkpoint stores it (module docstring); no bias.
    quantize_activations False: bf16 activations (W8A16, `Numerics.dense_fp8_activations`)."""

    def __init__(
        self, in_features: int, out_features: int, block: int, quantize_activations: bool = True
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = block
        self.quantize_activations = quantize_activations
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn)
        )
        self.register_buffer(
            "scale",
            torch.zeros(
                ceil_div(out_features, block),
                ceil_div(in_features, block),
                dtype=torch.float8_e8m0fnu,
            ),
        )

    def forward(self, x: Tensor, groups: int = 1) -> Tensor:
        """x [..., groups·in] → [..., out] in x's dtype; groups > 1: `grouped_linear`."""
        if not self.quantize_activations:
            return self._bf16_activations(x, groups)
        if runs_kernels(x):
            return fp8_gemm.fp8_block_gemm(
                x, self.weight, self.scale, block=self.block, groups=groups, out_dtype=x.dtype
            )
        y = fp8_gemm.fp8_block_gemm_reference(
            x, self.weight, self.scale, block=self.block, groups=groups
        )
        return y.to(x.dtype)

    def _bf16_activations(self, x: Tensor, groups: int) -> Tensor:
        """W8A16: up to `W8A16_MAX_ROWS` rows of a bf16 x on the kernel path through
        `kernels.fp8_weight_gemm` (the FP8 bytes streamed, decoded in registers); more rows,
        or elsewhere, through the weight dequantized to x's dtype and the dense path's GEMM
        (`dequantize_fp8_weight`, one launch, on the kernel path). The same products either
        way: the weights' values are the dequantized bf16 path's."""
        rows = x.numel() // max(x.shape[-1], 1)
        if runs_kernels(x) and x.dtype == torch.bfloat16:
            if rows <= W8A16_MAX_ROWS:
                return fp8_weight_gemm(x, self.weight, self.scale, groups=groups)
            weight = dequantize_fp8_weight(self.weight, self.scale)
        else:
            weight = fp8_gemm.dequantize_weight_reference(self.weight, self.scale, self.block)
            weight = weight.to(x.dtype)
        return dense_matmul(x, weight) if groups == 1 else grouped_matmul(x, weight, groups)

    def extra_repr(self) -> str:
        bf16 = "" if self.quantize_activations else ", bf16 activations"
        return f"in={self.in_features}, out={self.out_features}, fp8 block {self.block}{bf16}"


def grouped_linear(linear: nn.Module, x: Tensor, groups: int) -> Tensor:
    """x [..., G·K] through a weight [G·N, K] split in G row groups: group g of x's columns
    times rows g·N..(g+1)·N of the weight → [..., G·N] (the attention's `wo_a`)."""
    if isinstance(linear, FP8BlockLinear):
        return linear(x, groups)
    return grouped_matmul(x, linear.weight, groups, getattr(linear, "batch_invariant", False))


def grouped_matmul(x: Tensor, weight: Tensor, groups: int, batch_invariant: bool = False) -> Tensor:
    """x [..., G·K] · weight [G·N, K] in G row groups (`grouped_linear`)."""
    weight = weight.view(groups, -1, weight.shape[-1])
    x = x.unflatten(-1, (groups, -1))
    if batch_invariant:
        parts = [dense_matmul(x[..., g, :], weight[g], True) for g in range(groups)]
        return torch.cat(parts, -1)
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not x.is_cuda or grad:  # the CPU's GEMM rounds differently into a strided out
        return torch.einsum("...gi,goi->...go", x, weight).flatten(-2)
    # CUDA: one batched GEMM over the groups that writes each group's columns of the
    # [..., G·N] result in place (cuBLAS's strided batch with ldc = G·N), as einsum's GEMM
    # but without its copy to flatten the groups (out= has no autograd).
    lead, n = x.shape[:-2], weight.shape[1]
    out = torch.empty(*lead, groups * n, dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, groups, x.shape[-1]).transpose(0, 1)
    torch.bmm(rows, weight.transpose(1, 2), out=out.view(-1, groups, n).transpose(0, 1))
    return out


def keep_dense_fp8(
    model: nn.Module,
    fp8_weight_shapes: dict[str, tuple[int, int]],
    block: int,
    quantize_activations: bool = True,
) -> None:
    """Replace each `nn.Linear` named in `fp8_weight_shapes` (checkpoint weight name → [out,
    in]; e.g. `layers.0.attn.wq_a.weight`) by an `FP8BlockLinear` of that shape (with
    `quantize_activations`). Names the model does not have (an expert-parallel rank, DSpark
    left out) are skipped.

    Raises:
        ValueError: a named module is not an `nn.Linear` of that shape.
    """
    for name, (out_features, in_features) in fp8_weight_shapes.items():
        path = name.removesuffix(".weight")
        parent_path, _, attr = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
        except AttributeError:
            continue
        linear = getattr(parent, attr, None)
        if linear is None:
            continue
        if not isinstance(linear, nn.Linear) or tuple(linear.weight.shape) != (
            out_features,
            in_features,
        ):
            raise ValueError(f"{path} is not a dense linear [{out_features}, {in_features}]")
        setattr(
            parent, attr, FP8BlockLinear(in_features, out_features, block, quantize_activations)
        )
