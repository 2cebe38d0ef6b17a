"""The one-launch expert alignment against its torch reference: the same blocks, exactly.

The kernel's programs each rank one chunk of pairs (64 for decode blocks, 128 for prefill ones)
and write one share of the blocks; the cases below reach many chunks, a ragged last chunk, the
key tiles' edges, more block shares than chunks, and MAX_PAIRS itself."""

from __future__ import annotations

import pytest
import torch

from kernels.expert_alignment import MAX_PAIRS, align_to_experts, align_to_experts_reference
from tests.kernels.interpreted import run_interpreted

# (tokens, top_k, experts, block_m, skipped): skipped is the share of pairs marked −1, or "all",
# or "one" (every pair on one expert, a few skipped), or "one-full" (one expert, none skipped).
CASES = [
    (1, 2, 8, 16, 0.0),
    (1, 6, 384, 16, 0.5),
    (16, 6, 48, 16, 0.3),
    (16, 6, 384, 32, 0.3),
    (16, 2, 8, 16, "one-full"),
    (16, 6, 48, 16, "all"),
    (64, 6, 48, 64, 0.2),
    (64, 2, 384, 16, 0.0),
    (64, 6, 48, 16, "one"),
    (64, 6, 8, 32, 0.9),
    (683, 2, 48, 64, 0.3),
    (683, 2, 8, 128, 0.0),
    (682, 6, 384, 128, 0.1),  # 4,092 pairs
    (0, 6, 48, 16, 0.0),
    (683, 3, 48, 16, 0.2),  # 2,049 pairs: one past a decode key tile (2,048)
    (1366, 3, 48, 64, 0.2),  # 4,098 pairs: two past a prefill key tile (4,096)
    (1000, 6, 48, 16, 0.3),  # 6,000 pairs: 94 chunks, the last one ragged; 7 block shares
    (64, 6, 384, 16, 0.1),  # 408 blocks in 26 shares of 16, only 6 chunks
    (500, 6, 48, 16, "all"),  # 3,000 pairs, none placed: every block -1
    (2000, 6, 48, 128, "one-full"),  # one expert's 12,000 pairs across 94 chunks
    (1500, 6, 48, 32, "one"),  # one expert, every third token's second slot skipped
    (4096, 8, 48, 128, 0.1),  # 32,768 pairs: MAX_PAIRS
]


def routing(case, device: str = "cpu") -> torch.Tensor:
    """Skewed top-k ids [T, k] (a few experts get most pairs, some none), −1 where skipped."""
    num_tokens, top_k, num_experts, _, skipped = case
    generator = torch.Generator().manual_seed(num_tokens * 1000 + num_experts + top_k)
    scores = torch.rand(num_tokens, num_experts, generator=generator) ** 4
    scores[:, : num_experts // 4] += 0.5
    ids = torch.topk(scores, top_k, dim=-1).indices
    if skipped == "all":
        ids = torch.full_like(ids, -1)
    elif skipped in ("one", "one-full"):
        ids = torch.full_like(ids, num_experts // 2)
        if skipped == "one":
            ids[::3, 1] = -1
    else:
        drop = torch.rand(ids.shape, generator=generator) < skipped
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    return ids.to(device)


_INTERPRETED = """
import json
import torch
from kernels.expert_alignment import align_to_experts, align_to_experts_reference
from tests.kernels.test_expert_alignment import CASES, routing
result = []
for index in INDICES:
    case = CASES[index]
    ids = routing(case)
    ours = align_to_experts(ids, case[2], case[3])
    reference = align_to_experts_reference(ids, case[2], case[3])
    result.append([torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, reference)])
print(json.dumps(result))
"""
# Cases of at least this many pairs run in the slow tier (the interpreter walks every program).
LARGE_PAIRS = 4000


@pytest.mark.parametrize("large", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kernel_lays_out_the_reference_blocks_in_the_triton_interpreter(large: bool) -> None:
    indices = [i for i, case in enumerate(CASES) if (case[0] * case[1] >= LARGE_PAIRS) == large]
    result = run_interpreted(_INTERPRETED.replace("INDICES", repr(indices)))
    failed = [CASES[i] for i, same in zip(indices, result, strict=True) if not all(same)]
    assert indices and not failed


_DISPATCH = """
import json
import torch
import kernels.expert_alignment as alignment
from kernels.grouped_mxfp4_gemm import align_to_experts
from tests.kernels.test_expert_alignment import CASES, routing
reference = alignment.align_to_experts_reference
small = routing(CASES[2])
large = torch.cat([small] * (alignment.MAX_PAIRS // small.numel() + 1))  # past MAX_PAIRS
expected = [reference(small, 48, 16), reference(large, 48, 16)]
def refuse(*args):
    raise AssertionError("the torch reference ran")
alignment.align_to_experts_reference = refuse
kernel = align_to_experts(small, 48, 16)
try:
    align_to_experts(large, 48, 16)
    large_took = "kernel"
except AssertionError:
    large_took = "reference"
alignment.align_to_experts_reference = reference
blocks = align_to_experts(large, 48, 16)
same = [
    torch.equal(got.pair_of_pos, want[0]) and torch.equal(got.block_expert, want[1])
    for got, want in zip((kernel, blocks), expected)
]
print(json.dumps([large_took, same]))
"""


def test_grouped_gemm_alignment_takes_the_kernel_up_to_max_pairs() -> None:
    """`grouped_mxfp4_gemm.align_to_experts`: one launch where the kernels run (the torch
    reference never called), the reference above MAX_PAIRS; the same blocks both ways."""
    large_took, same = run_interpreted(_DISPATCH)
    assert large_took == "reference" and all(same)


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    ids = routing(CASES[2])
    with pytest.raises(ValueError, match="power of two"):
        align_to_experts(ids, 48, 24)
    with pytest.raises(ValueError, match="at most"):
        align_to_experts(torch.zeros(MAX_PAIRS + 1, 1, dtype=torch.long), 48, 16)
    with pytest.raises(ValueError, match="integer"):
        align_to_experts(ids.float(), 48, 16)
    with pytest.raises(ValueError, match="CUDA"):
        align_to_experts(ids, 48, 16)


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph() -> None:
    # one capture per pair count: new ids of the same shape, the reference's blocks each replay
    case = (256, 6, 48, 32, 0.0)
    ids = routing(case, "cuda")
    align_to_experts(ids, 48, 32)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        blocks = align_to_experts(ids, 48, 32)
    for skipped in (0.0, 0.4, "one", "all"):
        ids.copy_(routing((256, 6, 48, 32, skipped), "cuda"))
        graph.replay()
        reference = align_to_experts_reference(ids, 48, 32)
        assert all(torch.equal(a, b) for a, b in zip(blocks, reference, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_kernel_lays_out_the_reference_blocks_on_cuda(case) -> None:
    ids = routing(case, "cuda")
    for ids_dtype in (torch.int64, torch.int32):
        ours = align_to_experts(ids.to(ids_dtype), case[2], case[3])
        reference = align_to_experts_reference(ids, case[2], case[3])
        assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
