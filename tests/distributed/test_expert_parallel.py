"""Expert parallelism on N spawned gloo ranks (N = 2, 4) against one process, `tiny` model.

One spawn per N runs every multi-process check (`workers.all_checks`); the tests below read its
results. Ranks get uneven token counts and one rank has none (a zero-token step).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models import write_random_checkpoint
from engine.models.deepseek_v41.config import preset_config
from engine.models.deepseek_v41.loading import engram_token_map
from tests.distributed import workers
from tests.distributed.spawn import run_ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_random_checkpoint("tiny", tmp_path_factory.mktemp("ep") / "tiny", seed=3)
    engram_token_map(folder, preset_config("tiny"))  # cache it before ranks read it at once
    return folder


# 4 ranks: ~11 s to spawn and run on 2 cores, so in the slow tier; 2 ranks run by default
@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["ep2", "ep4"]
)
def ranks(request: pytest.FixtureRequest, checkpoint: Path) -> list[dict]:
    return run_ranks(workers.all_checks, request.param, str(checkpoint))


def test_coordinator_agrees_on_every_ranks_work_and_sleeps_when_idle(ranks: list[dict]) -> None:
    world = len(ranks)
    want_tokens = [
        tuple(r + 1 for r in range(world)),
        (3,) + (0,) * (world - 1),
        (0,) * world,
    ]
    for rank, result in enumerate(ranks):
        got = result["coordinator"]
        assert [tuple(t) for t in got["num_tokens"]] == want_tokens
        assert got["has_work"] == [True, True, False]
        assert got["zero_token"] == [False, rank != 0, False]
        assert got["buckets"] == [world if world in (2, 4) else None, 4, 1]
        assert len(got["slept"]) == 1  # only the step where nobody had work


def test_dispatchers_equal_the_single_process_combine(ranks: list[dict]) -> None:
    for result in ranks:
        got = result["dispatch"]
        for name in ("all_to_all", "fixed_big", "fixed_tiny", "fixed_one_pass"):
            assert got[f"{name}/ordered/exact"], (name, got)  # fixed expert-id order: bitwise
            assert got[f"{name}/fast/rel"] <= 1e-6, (name, got)
    assert any(result["dispatch"]["num_tokens"] == 0 for result in ranks)


def test_fixed_capacity_equals_all_to_all_with_and_without_overflow(ranks: list[dict]) -> None:
    for result in ranks:
        got = result["dispatch"]
        assert got["fixed_big/passes"] == 1
        for tag in ("fast", "ordered"):
            assert got[f"fixed_big/{tag}/equals_all_to_all"]
            assert got[f"fixed_tiny/{tag}/equals_all_to_all"]
            # the padded layout end to end (12 tokens = the capacity), bitwise the same
            assert got[f"fixed_one_pass/{tag}/equals_all_to_all"]
    # 12 tokens on one rank over capacity 1: every rank ran the same extra passes.
    passes = {result["dispatch"]["fixed_tiny/passes"] for result in ranks}
    assert len(passes) == 1 and passes.pop() > 1


def test_each_rank_holds_only_its_experts(ranks: list[dict]) -> None:
    world = len(ranks)
    per_rank = 8 // world
    for rank, result in enumerate(ranks):
        got = result["model"]
        assert got["loaded_experts"] == list(range(rank * per_rank, (rank + 1) * per_rank))
        assert got["dspark_experts"] == 4  # DSpark stages stay whole (replicated)


def test_ep_moe_layer_matches_one_process(ranks: list[dict]) -> None:
    """Fast combine, plain BLAS: each MoE layer on the same inputs within 1e-6 relative."""
    for result in ranks:
        assert result["model"]["moe_layer_rel"] <= 1e-6, result["model"]


def test_ep_forward_matches_one_process(ranks: list[dict]) -> None:
    """Whole forward steps (fast combine): BLAS rounding differs with the rows an expert sees,
    and 8 layers of routing and indexer top-k amplify it, so logits agree to 1e-3."""
    for result in ranks:
        got = result["model"]
        assert got["fast/all_to_all/rel"] <= 1e-3, got
        assert got["fast/fixed_big/equals_all_to_all"], got  # nothing overflows: same bits


def test_ep_forward_is_bitwise_in_batch_invariant_mode(ranks: list[dict]) -> None:
    for result in ranks:
        got = result["model"]
        assert got["invariant/all_to_all/exact"], got
        assert got["invariant/fixed_overflow/exact"], got  # capacity 2 < 17 tokens: overflow


def test_ep_forward_with_host_engram_tables_is_bitwise_the_device_tables(
    ranks: list[dict],
) -> None:
    """Each rank maps the Engram tables from the same shards (one page-cache copy per node)
    and gathers its own tokens' rows: same logits as tables on the rank, and as one process."""
    for result in ranks:
        got = result["model"]
        assert got["host_engram_tables"] == [0, 1], got
        assert got["host_engram/equals_device"], got
        assert got["invariant/all_to_all/host_engram/exact"], got


def test_scenario_has_uneven_and_zero_token_ranks(ranks: list[dict]) -> None:
    per_step = list(zip(*(result["model"]["tokens_per_step"] for result in ranks), strict=True))
    assert any(0 in step and any(step) for step in per_step)  # a zero-token step
    assert any(len({n for n in step if n}) > 1 for step in per_step)  # uneven counts
    assert not any(per_step[-1])  # the last step is idle everywhere
