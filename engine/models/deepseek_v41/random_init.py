"""A model with random weights drawn directly on a device (benchmarks of full-width configs).

The checkpoint writer draws on the CPU so that bytes are reproducible everywhere; that is far too
slow for the ~50 GB of one EP8 rank. Here every tensor of the inventory is drawn on `device` with
the writer's distributions (`init_mean_std`) and put into a model built on `meta`:

    bf16 / f32 / fp8 (dense)   drawn in the model dtype (fp32 where the model keeps fp32);
                               fp8 block-quantised as stored with `numerics.dense_fp8`
    mxfp4 (routed experts)     random e2m1 codes, scale 2^-8 (std ≈ 0.012, like 1/sqrt(5120));
                               kept packed with `quantized_experts`, else dequantised
    fp8_rows (Engram tables)   drawn then row-quantised to FP8 (as stored)

The values differ from the writer's (other generator) but have the same distributions.
"""

from __future__ import annotations

import torch

from engine.models.deepseek_v41.checkpoint_loader import keeps_fp32, stored_kinds
from engine.models.deepseek_v41.checkpoint_writer import init_mean_std
from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.inventory import TensorSpec, full_inventory, text_inventory
from engine.models.deepseek_v41.model import DeepseekV41ForCausalLM, Numerics
from engine.models.deepseek_v41.weight_formats import (
    MXFP4_BLOCK,
    fp8_block_quantize,
    fp8_row_quantize,
    mxfp4_dequantize,
)

MXFP4_RANDOM_SCALE_EXPONENT = -8
_ENGRAM_CHUNK_ROWS = 1 << 20


def random_model(
    cfg: DeepseekV41Config,
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    quantized_experts: bool = True,
    include_dspark: bool = True,
    seed: int = 0,
    numerics: Numerics | None = None,
) -> DeepseekV41ForCausalLM:
    """`cfg`'s model with random weights drawn on `device` (see the module docstring)."""
    device = torch.device(device)
    numerics = numerics or Numerics()
    kept = stored_kinds(quantized_experts, numerics.dense_fp8)
    generator = torch.Generator(device=device).manual_seed(seed)
    specs = full_inventory(cfg) if include_dspark else text_inventory(cfg)
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(
            cfg,
            dtype,
            numerics,
            include_dspark=include_dspark,
            quantized_experts=quantized_experts,
        )
    tensors: dict[str, torch.Tensor] = {}
    for spec in specs:
        tensors.update(_draw(spec, cfg.fp8_block_size, device, dtype, kept, generator))
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"random weights do not match the model: {missing[:5]} {unexpected[:5]}")
    del tensors  # the model holds them; packing the experts must not hold two copies
    model = model.to(device)
    if quantized_experts:
        model.pack_routed_experts()
    model.pack_attention_projections()
    vocab = torch.arange(cfg.vocab_size, device=device)
    model.set_engram_token_map(vocab % cfg.engram_compressed_vocab_size)
    return model.eval()


def _draw(
    spec: TensorSpec,
    fp8_block: int,
    device: torch.device,
    dtype: torch.dtype,
    kept: tuple[str, ...],
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    if spec.kind == "mxfp4":
        n, k = spec.shape
        packed = torch.randint(-128, 128, (n, k // 2), generator=generator, device=device)
        scale_bytes = torch.full(
            (n, k // MXFP4_BLOCK), 127 + MXFP4_RANDOM_SCALE_EXPONENT, dtype=torch.uint8
        )
        scale = scale_bytes.to(device).view(torch.float8_e8m0fnu)
        packed = packed.to(torch.int8)
        if "mxfp4" in kept:
            return {spec.name: packed, spec.scale_name: scale}
        return {spec.name: mxfp4_dequantize(packed, scale, dtype=dtype)}
    mean, std = init_mean_std(spec)
    if spec.kind == "fp8_rows":
        rows, width = spec.shape
        weights, scales = [], []
        for start in range(0, rows, _ENGRAM_CHUNK_ROWS):
            shape = (min(_ENGRAM_CHUNK_ROWS, rows - start), width)
            values = torch.randn(shape, generator=generator, device=device) * std + mean
            weight, scale = fp8_row_quantize(values)
            weights.append(weight)
            scales.append(scale)
        return {spec.name: torch.cat(weights), spec.scale_name: torch.cat(scales)}
    target = torch.float32 if keeps_fp32(spec.name) else dtype
    values = torch.randn(spec.shape, generator=generator, device=device, dtype=torch.float32)
    values = values.mul_(std).add_(mean)
    if spec.kind == "fp8" and "fp8" in kept:
        weight, scale = fp8_block_quantize(values, fp8_block)
        return {spec.name: weight, spec.scale_name: scale}
    return {spec.name: values.to(target)}
