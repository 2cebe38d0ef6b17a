"""Decode attention over encoded rows against its torch reference (interpreter and CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.kv_formats import global_fp4_quantize, swa_mxfp8_quantize
from kernels.sparse_mqa_decode import sparse_mqa_decode, sparse_mqa_decode_reference
from tests.kernels.interpreted import run_interpreted

# (sequences, heads, head dim, window, ring length, ratio, selected): tiny-, default- and
# release-like layers, with and without a KV source.
CASES = [
    (3, 4, 64, 16, 23, 2, 8),
    (3, 8, 128, 128, 134, 1, 40),
    (2, 24, 64, 32, 38, 0, 0),
    (2, 64, 512, 128, 134, 2, 512),
]


def _inputs(case, device: str = "cpu"):
    num_seqs, heads, dim, window, ring_len, ratio, num_selected = case
    generator = torch.Generator().manual_seed(sum(case))
    q = torch.randn(num_seqs, heads, dim, generator=generator)
    ring = swa_mxfp8_quantize(torch.randn(num_seqs + 2, ring_len, dim, generator=generator) * 2)
    slots = torch.randperm(num_seqs + 2, generator=generator)[:num_seqs]
    positions = torch.tensor([5, 3 * window + 7, window - 1][:num_seqs])  # window partly empty
    sink = torch.randn(heads, generator=generator)
    global_rows = None
    if ratio:
        per_block = 128 // ratio
        pool = global_fp4_quantize(torch.randn(24, per_block, dim, generator=generator))
        tables = torch.stack([torch.randperm(24, generator=generator)[:6] for _ in range(num_seqs)])
        selection = torch.randint(-1, 6 * per_block, (num_seqs, num_selected), generator=generator)
        selection[0] = -1  # a sequence with nothing selected
        global_rows = (pool, selection, tables, ratio)
    tensors = (q, ring, slots, positions, sink)
    moved = [t.to(device) for t in tensors]
    if global_rows is not None:
        global_rows = (*(t.to(device) for t in global_rows[:3]), ratio)
    return (*moved, window, dim**-0.5, global_rows)


_INTERPRETED = """
import json, sys, torch
from tests.kernels.test_sparse_mqa_decode import CASES, _inputs
from kernels.sparse_mqa_decode import sparse_mqa_decode, sparse_mqa_decode_reference
errors = []
for case in CASES[:3]:
    args = _inputs(case)
    ours, reference = sparse_mqa_decode(*args), sparse_mqa_decode_reference(*args)
    errors.append(float((ours - reference).norm() / reference.norm()))
print(json.dumps(errors))
"""


def test_kernel_logic_matches_reference_in_the_triton_interpreter() -> None:
    errors = run_interpreted(_INTERPRETED)
    assert len(errors) == 3 and max(errors) < 1e-5


def test_launcher_rejects_layouts_it_cannot_take() -> None:
    q, ring, slots, positions, sink, window, scale, _ = _inputs(CASES[0])
    with pytest.raises(ValueError, match="multiple of 16"):
        sparse_mqa_decode(q, ring, slots, positions, sink, 24, scale)
    with pytest.raises(ValueError, match="uint8"):
        sparse_mqa_decode(q, ring.float(), slots, positions, sink, window, scale)
    with pytest.raises(ValueError, match="CUDA"):
        sparse_mqa_decode(q, ring, slots, positions, sink, window, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_on_cuda(case) -> None:
    args = _inputs(case, "cuda")
    ours, reference = sparse_mqa_decode(*args), sparse_mqa_decode_reference(*args)
    assert float((ours - reference).norm() / reference.norm()) < 1e-5
    bf16 = (args[0].bfloat16(), *args[1:])  # the model's bf16 queries
    ours, reference = sparse_mqa_decode(*bf16), sparse_mqa_decode_reference(*bf16)
    assert float((ours - reference).norm() / reference.norm()) < 1e-5
