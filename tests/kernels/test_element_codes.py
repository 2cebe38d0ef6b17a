"""The references' decoders (`kernels.element_codes`) equal the model's codecs on every byte."""

from __future__ import annotations

import torch

from engine.models.deepseek_v41 import kv_formats
from engine.models.deepseek_v41.weight_formats import mxfp4_dequantize, mxfp4_quantize
from kernels.element_codes import (
    e2m1_pairs_to_float,
    e4m3_to_float,
    fp4_rows_to_float,
    mxfp4_to_float,
    mxfp8_rows_to_float,
    ue8m0_to_float,
)

EVERY_BYTE = torch.arange(256, dtype=torch.uint8)


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return ours.dtype == theirs.dtype and bool(
        ((ours == theirs) | (ours.isnan() & theirs.isnan())).all()
    )


def test_element_codes_match_the_kv_codecs() -> None:
    assert _same(
        e2m1_pairs_to_float(EVERY_BYTE[:, None]), kv_formats.decode_e2m1_bytes(EVERY_BYTE[:, None])
    )
    assert _same(e4m3_to_float(EVERY_BYTE), kv_formats.e4m3_to_float(EVERY_BYTE))
    assert _same(ue8m0_to_float(EVERY_BYTE), kv_formats.ue8m0_to_float(EVERY_BYTE))


def test_row_decoders_match_the_kv_formats() -> None:
    x = torch.randn(5, 3, 128, generator=torch.Generator().manual_seed(0)) * 7
    swa = kv_formats.swa_mxfp8_quantize(x)
    fp4 = kv_formats.global_fp4_quantize(x)
    assert torch.equal(mxfp8_rows_to_float(swa), kv_formats.swa_mxfp8_dequantize(swa))
    assert torch.equal(fp4_rows_to_float(fp4), kv_formats.global_fp4_dequantize(fp4))


def test_expert_decoder_matches_the_checkpoint_loader() -> None:
    codes, scales = mxfp4_quantize(torch.randn(48, 256, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(mxfp4_to_float(codes, scales), mxfp4_dequantize(codes, scales))
