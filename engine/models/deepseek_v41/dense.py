"""Dense FP8 linears (`Numerics.dense_fp8`): the checkpoint's block-scaled weights kept as stored.

Every dense linear of the checkpoint is FP8 with one ue8m0 scale per `fp8_block_size`² tile
(`model.md` §5.3): the attention projections (`wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`), the
indexer's `wq_b`, the shared experts, Engram's `wkv` and DSpark's `main_proj`. By default the
loader dequantizes them to the compute dtype and `nn.Linear` runs them. With `dense_fp8` they
become `FP8BlockLinear`: `weight` float8_e4m3fn [out, in] and `scale` float8_e8m0fnu (the stored
names and bytes), activations quantized to FP8 per (row, block of input columns) and multiplied
on FP8 tensor cores by `kernels.fp8_block_gemm` (fp32 accumulation, output in x's dtype).

On the CPU (tests, the end-to-end error in docs/model.md) the kernel's numerics run as its
torch reference: the same activation codes and scales, both operands dequantized, a float32
product. The engine does not offer that for serving (`EngineConfig.dense_gemm`).

`grouped_linear` is the one call site that is not `module(x)`: `wo_a`'s 8 groups.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.models.deepseek_v41.config import ceil_div
from kernels import fp8_block_gemm as fp8_gemm


class FP8BlockLinear(nn.Module):
    """`y = x · Wᵀ` with W as the checkpoint stores it (module docstring); no bias."""

    def __init__(self, in_features: int, out_features: int, block: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = block
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
        if x.is_cuda:
            return fp8_gemm.fp8_block_gemm(
                x, self.weight, self.scale, block=self.block, groups=groups, out_dtype=x.dtype
            )
        y = fp8_gemm.fp8_block_gemm_reference(
            x, self.weight, self.scale, block=self.block, groups=groups
        )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 block {self.block}"


def grouped_linear(linear: nn.Module, x: Tensor, groups: int) -> Tensor:
    """x [..., G·K] through a weight [G·N, K] split in G row groups: group g of x's columns
    times rows g·N..(g+1)·N of the weight → [..., G·N] (the attention's `wo_a`)."""
    if isinstance(linear, FP8BlockLinear):
        return linear(x, groups)
    weight = linear.weight.view(groups, -1, linear.weight.shape[-1])
    return torch.einsum("...gi,goi->...go", x.unflatten(-1, (groups, -1)), weight).flatten(-2)


def keep_dense_fp8(
    model: nn.Module, fp8_weight_shapes: dict[str, tuple[int, int]], block: int
) -> None:
    """Replace each `nn.Linear` named in `fp8_weight_shapes` (checkpoint weight name → [out,
    in]; e.g. `layers.0.attn.wq_a.weight`) by an `FP8BlockLinear` of that shape. Names the model
    does not have (an expert-parallel rank, DSpark left out) are skipped.

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
        setattr(parent, attr, FP8BlockLinear(in_features, out_features, block))
