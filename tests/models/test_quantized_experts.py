"""Routed experts kept in their MXFP4 checkpoint storage compute what dequantised ones do."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models import load_model
from engine.models.deepseek_v41.moe import MXFP4Linear


def test_mxfp4_experts_give_the_dequantised_logits(tiny_checkpoint: Path, tiny_model) -> None:
    quantized = load_model(tiny_checkpoint, quantized_experts=True, progress=False)
    expert = quantized.layers[0].ffn.experts[0]
    assert isinstance(expert.w1, MXFP4Linear) and expert.w1.weight.dtype == torch.int8
    assert not isinstance(quantized.layers[0].ffn.shared_experts.w1, MXFP4Linear)
    dense_bytes = sum(p.numel() * p.element_size() for p in tiny_model.parameters())
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*quantized.parameters(), *quantized.buffers()]
        if t.dtype != torch.long
    }
    assert sum(storages.values()) < dense_bytes
    # The kernel's stacked experts are the experts' storage, not a second copy.
    ffn = quantized.layers[0].ffn
    for stack, linear in ((ffn.w13_codes, expert.w3), (ffn.w2_scales, ffn.experts[-1].w2)):
        tensor = linear.weight if stack.dtype == torch.int8 else linear.scale
        assert tensor.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    prompts = [[0, *range(5, 70)], [0, 9, 8, 7]]
    assert torch.equal(quantized.logits(prompts), tiny_model.logits(prompts))
    drafts = quantized.mtp[0].ffn.experts[0].w2
    assert isinstance(drafts, MXFP4Linear)


def test_random_model_on_a_device_runs(tiny_model) -> None:
    from engine.models.deepseek_v41.random_init import random_model

    model = random_model(tiny_model.config, "cpu", torch.float32, seed=3)
    assert isinstance(model.layers[1].ffn.experts[2].w3, MXFP4Linear)
    logits = model.logits([[0, 5, 6, 7, 8]])
    assert logits.shape == (1, 5, tiny_model.config.vocab_size) and torch.isfinite(logits).all()
    again = random_model(tiny_model.config, "cpu", torch.float32, seed=3)
    assert torch.equal(again.logits([[0, 5, 6, 7, 8]]), logits)


def test_experts_whose_scales_the_decode_tiles_cannot_unpack_take_the_prefill_tiles(
    tiny_checkpoint: Path,
) -> None:
    from engine.models.deepseek_v41.moe import _block_m

    quantized = load_model(tiny_checkpoint, quantized_experts=True, progress=False)
    ffn = quantized.layers[0].ffn
    assert ffn.decode_tiles_exact  # the writer's random experts have small scales
    assert _block_m(16 * 6, 48, ffn.decode_tiles_exact) == 16
    ffn.w2_scales.view(torch.uint8)[0, 0, 0] = 129  # an expert block with max |w| > 12
    ffn.pack_experts()
    assert not ffn.decode_tiles_exact
    assert _block_m(16 * 6, 48, ffn.decode_tiles_exact) == 64  # the exact (prefill) kernel
