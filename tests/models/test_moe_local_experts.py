"""An EP rank's local experts (`MoE.run_local_experts`): the grouped MXFP4 kernel on the received
(row, local expert, weight) pairs equals the per-expert reference loop.

The kernel's logic runs in Triton's CPU interpreter (prefill tiles: the decode tiles' inline PTX
has no interpreter); the same comparison on CUDA is `gpu`-marked. One rank of an EP2 group over
16 experts holds 8; the pairs arrive unsorted, one local expert gets none, and a rank may
receive nothing.
"""

from __future__ import annotations

import pytest
import torch

from engine.distributed.dispatch import ExpertPlacement, RecvBatch, plan_send
from engine.distributed.dispatch.all_to_all import AllToAllDispatcher
from engine.models.deepseek_v41.moe import MoE
from tests.kernels.interpreted import run_interpreted
from tests.kernels.test_grouped_mxfp4_gemm import fill_random

NUM_EXPERTS, EP_SIZE, RANK, TOP_K = 16, 2, 1, 3
LOCAL = NUM_EXPERTS // EP_SIZE
IDLE_EXPERT = 5  # a local expert no pair is routed to


def rank_moe(dim: int, inter: int, seed: int, device: str = "cpu") -> MoE:
    """Rank 1 of EP2: 8 MXFP4 experts with random codes and small scales (the decode tiles'
    exact range), unpacked (the reference loop) until `pack_experts`."""
    placement = ExpertPlacement(NUM_EXPERTS, EP_SIZE, RANK)
    torch.manual_seed(seed)
    moe = MoE(
        dim,
        inter,
        NUM_EXPERTS,
        TOP_K,
        2.5,
        7.0,
        torch.bfloat16,
        quantized_experts=True,
        dispatcher=AllToAllDispatcher(placement, None),  # never called: no group needed
    )
    return fill_random(moe).to(device)


def received(num_rows: int, dim: int, seed: int, all_valid: bool = False, device: str = "cpu"):
    """A `RecvBatch` of `num_rows` rows: each row's 3 slots hold a local expert or −1 (served
    elsewhere), at least one local; experts in random order, `IDLE_EXPERT` never."""
    gen = torch.Generator().manual_seed(seed)
    busy = torch.tensor([e for e in range(LOCAL) if e != IDLE_EXPERT])
    local = busy[torch.rand(num_rows, len(busy), generator=gen).argsort(1)[:, :TOP_K]]
    if not all_valid:
        elsewhere = torch.rand(num_rows, TOP_K, generator=gen) < 0.5
        elsewhere[:, torch.randint(0, TOP_K, (1,), generator=gen)] = False
        local = torch.where(elsewhere, torch.full_like(local, -1), local)
    placement = ExpertPlacement(NUM_EXPERTS, EP_SIZE, RANK)
    return RecvBatch(
        x=torch.randn(num_rows, dim, generator=gen).bfloat16().to(device),
        local_ids=local.to(device),
        weights=torch.rand(num_rows, TOP_K, generator=gen).to(device),
        recv_counts=torch.tensor([num_rows, 0], device=device),
        plan=plan_send(torch.zeros(0, TOP_K, dtype=torch.long, device=device), placement),
    )


# (rows received, all slots local, weight before down, batch invariant): an empty rank; few
# pairs (blocks of 64); weights before the down GEMM; fixed tiles; 750 pairs (blocks of 128).
CASES = [
    (0, False, False, False),
    (23, False, False, False),
    (23, False, True, False),
    (23, False, False, True),
    (250, True, False, False),
]


def local_expert_errors(device: str = "cpu") -> list[dict]:
    """Per case: pairs, the slot layout's shape and zeros, whether the kernel ran, relative
    norm error of the grouped pair outputs against the loop's, the worst pair's relative
    error, and (fixed tiles) whether a row's outputs alone equal them inside the batch bitwise."""
    results = []
    for num_rows, all_valid, before_down, invariant in CASES:
        moe = rank_moe(dim=64, inter=96, seed=num_rows, device=device)
        moe.weight_before_down = before_down
        moe.batch_invariant = invariant
        recv = received(num_rows, 64, seed=num_rows + 1, all_valid=all_valid, device=device)
        reference = moe.run_local_experts(recv)  # unpacked: the loop
        moe.pack_experts()
        grouped = moe.run_local_experts(received(num_rows, 64, num_rows + 1, all_valid, device))
        batch = grouped
        result = {
            "pairs": int((recv.local_ids >= 0).sum()),
            "shape": list(grouped.shape),
            "shape_equal": grouped.shape == reference.shape,
            "zero_elsewhere": bool((grouped[recv.local_ids < 0] == 0).all()),
        }
        if num_rows:
            grouped, reference = grouped[recv.local_ids >= 0], reference[recv.local_ids >= 0]
            # the kernel ran: its fp32 down output is not rounded to bf16 as each loop call's is
            result["kernel_ran"] = not torch.equal(grouped, reference)
            diff = (grouped - reference).norm(dim=1)
            result["rel"] = float(diff.norm() / reference.norm())
            result["worst_row"] = float((diff / reference.norm(dim=1)).max())
        if invariant:
            alone = received(num_rows, 64, num_rows + 1, all_valid, device)
            alone.x, alone.local_ids, alone.weights = (
                alone.x[:1],
                alone.local_ids[:1],
                alone.weights[:1],
            )
            result["alone_equal"] = torch.equal(moe.run_local_experts(alone)[0], batch[0])
        results.append(result)
    return results


def _check(results: list[dict]) -> None:
    # a rank that received nothing
    assert results[0] == {
        "pairs": 0,
        "shape": [0, 3, 64],
        "shape_equal": True,
        "zero_elsewhere": True,
    }
    for result in results[1:]:
        assert result["shape_equal"] and result["pairs"] > 0 and result["kernel_ran"]
        assert result["zero_elsewhere"]  # the slot layout `combine` takes
        # the single-rank grouped path's bound against the reference path (same rounding points)
        assert result["rel"] < 1e-2, result
        assert result["worst_row"] < 3e-2, result  # each pair's output in `pairs` order
    assert results[3]["alone_equal"]
    assert results[4]["pairs"] == 750


_INTERPRETED = """
import json
from tests.models.test_moe_local_experts import local_expert_errors
print(json.dumps(local_expert_errors()))
"""


def test_grouped_local_experts_equal_the_loop_in_the_triton_interpreter() -> None:
    _check(run_interpreted(_INTERPRETED))


def test_without_the_interpreter_the_cpu_runs_the_loop() -> None:
    moe = rank_moe(dim=64, inter=96, seed=0)
    recv = received(9, 64, seed=1)
    before = moe.run_local_experts(recv)
    moe.pack_experts()
    assert torch.equal(moe.run_local_experts(received(9, 64, seed=1)), before)


@pytest.mark.gpu
def test_grouped_local_experts_equal_the_loop_on_cuda() -> None:
    _check(local_expert_errors("cuda"))
