"""The step-time table (`dspark.md` §3.4): profiling, shape, cache, fallback."""

from __future__ import annotations

import json
import logging
import math

import pytest

from engine.speculative.planner import PlanRow, ScheduledPlanner, scheduled_planner
from engine.speculative.profiling import ModelForwards
from engine.speculative.step_times import (
    ProfileConfig,
    StepTimeTable,
    TableKey,
    config_hash,
    graph_tiers,
    load_or_profile,
    load_table,
    profile_step_times,
    save_table,
    tier_for,
)


class VirtualDevice:
    """Forwards with known costs on a virtual clock: draft(n) = 1 + 0.02·n ms, verify(m, n) =
    5 + 0.01·tier(m) + 0.03·n ms (rows pad to the tier, as a graph replay does)."""

    def __init__(self, tiers):
        self.tiers, self.now = tiers, 0.0

    def clock(self) -> float:
        return self.now

    def run_draft(self, n: int) -> None:
        self.now += (1 + 0.02 * n) / 1e3

    def run_verify(self, m: int, n: int) -> None:
        assert 1 <= n <= m
        self.now += (5 + 0.01 * tier_for(m, self.tiers) + 0.03 * n) / 1e3


def test_graph_tiers_follow_the_design_grid():
    tiers = graph_tiers(600)
    assert tiers[:8] == (8, 16, 24, 32, 40, 48, 56, 64)
    assert tiers[8:11] == (80, 96, 112) and 256 in tiers and 288 in tiers and 512 in tiers
    assert tiers[-2:] == (576, 640)
    assert tier_for(65, tiers) == 80 and tier_for(641, tiers) is None


def test_profiling_recovers_known_costs():
    tiers = graph_tiers(96)
    device = VirtualDevice(tiers)
    default = profile_step_times(device.run_draft, device.run_verify, tiers, clock=device.clock)
    assert default.draft_buckets == tiers and default.alpha_ms == pytest.approx(0.03)
    table = profile_step_times(
        device.run_draft,
        device.run_verify,
        tiers,
        (1, 8, 16),
        ProfileConfig(repeats=3),
        clock=device.clock,
    )
    assert table.alpha_ms == pytest.approx(0.03)
    assert table.draft_ms == pytest.approx((1.02, 1.16, 1.32))
    assert table.verify_ms == pytest.approx(tuple(5 + 0.01 * m for m in tiers))
    # T(N, M) = T_draft(N) + T_verify(M) + α·N, step-shaped by tier
    assert table.step_ms(8, 20) == pytest.approx(1.16 + 5.24 + 0.24)
    assert table.step_ms(8, 17) == table.step_ms(8, 24)
    assert table.step_ms(5, 24) == pytest.approx(table.step_ms(8, 24) - 3 * 0.03)


def test_the_table_is_monotone_and_extrapolates_linearly():
    """Noisy measurements become running maxima; beyond the last point the last slope."""
    cost = {(16, 16): 3.0, (16, 3): 2.0, (8, 1): 4.0, (16, 2): 3.5, (24, 3): 4.5}
    now = [0.0]

    def verify(m, n):
        now[0] += cost[m, n] / 1e3

    table = profile_step_times(
        lambda n: None, verify, (8, 16, 24), (1,),
        ProfileConfig(repeats=1, warmup=0, rows_per_request=8), clock=lambda: now[0],
    )  # fmt: skip
    # α from (16 rows, 16 requests) = 3 ms and (16 rows, 3 requests) = 2 ms: 1/13 ms per request
    alpha = 1.0 / 13
    assert table.alpha_ms == pytest.approx(alpha)
    assert table.verify_ms == pytest.approx((4.0 - alpha, 4.0 - alpha, 4.5 - 3 * alpha))
    assert all(b >= a for a, b in zip(table.verify_ms, table.verify_ms[1:], strict=False))
    assert table.verify_time(40) == pytest.approx(table.verify_ms[-1] + 2 * (0.5 - 2 * alpha))
    steep = StepTimeTable((1, 2), (1.0, 2.0), (8, 16), (1.0, 3.0))
    assert steep.verify_time(32) == pytest.approx(7.0) and steep.draft_time(4) == 4.0
    with pytest.raises(ValueError):
        StepTimeTable((1,), (1.0,), (8, 16), (3.0, 2.0))


def test_profiling_the_tiny_model_with_real_forwards(tiny_model):
    """Real draft and verify forwards of the `tiny` model on the CPU (`ModelForwards`): the
    table is built, monotone, and more rows never predict a faster step."""
    forwards = ModelForwards(tiny_model, max_requests=8, context_len=24)
    table = profile_step_times(
        forwards.run_draft, forwards.run_verify, (8, 16, 24), (1, 4, 8),
        ProfileConfig(2, 1, 3.5, 8), sync=forwards.sync,
    )  # fmt: skip
    assert len(table.verify_ms) == 3 and table.verify_ms[0] > 0 and table.draft_ms[0] > 0
    assert table.step_ms(8, 24) >= table.step_ms(8, 8) >= table.step_ms(1, 8) > 0
    assert math.isfinite(table.alpha_ms)


def test_in_eager_mode_the_scheduled_planner_has_no_table_and_verifies_all(tiny_model, caplog):
    """§3.6: eager mode (the CPU: no CUDA graphs) → no table → verify-all, one warning."""
    planner = scheduled_planner(tiny_model)
    assert isinstance(planner, ScheduledPlanner) and planner.table is None
    assert planner.num_speculative_tokens == tiny_model.config.dspark_block_size
    rows = [PlanRow(cap=5, survivals=(0.01,) * 5)] * 4
    with caplog.at_level(logging.WARNING):
        assert planner.plan(rows, 0).is_verify_all and planner.budget(rows, 0) == 20
    assert sum("no step-time table" in r.message for r in caplog.records) == 1


@pytest.mark.gpu
def test_on_cuda_the_table_is_profiled_once_then_loaded(tiny_checkpoint, tmp_path):
    from engine.models import load_model

    model = load_model(tiny_checkpoint, device="cuda")
    model.enable_cuda_graphs()
    first = scheduled_planner(model, max_requests=8, context_len=256, cache_dir=tmp_path)
    assert first.table is not None and first.table.verify_tiers[-1] >= 48
    files = list(tmp_path.glob("step_times_*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    again = scheduled_planner(model, max_requests=8, context_len=256, cache_dir=tmp_path)
    assert again.table == first.table and files[0].stat().st_mtime_ns == mtime


def key(**changes) -> TableKey:
    base = dict(
        device_name="NVIDIA H200",
        config_hash=config_hash({"layers": 40}),
        tiers=(8, 16),
        draft_buckets=(1, 8),
        context_len=8192,
    )
    return TableKey(**{**base, **changes})


def test_the_cache_returns_a_table_only_for_its_key(tmp_path):
    table = StepTimeTable((1, 8), (1.0, 1.5), (8, 16), (5.0, 6.0), 0.01)
    path = tmp_path / key().file_name()
    save_table(table, path, key())
    assert load_table(path, key()) == table
    for other in (
        key(device_name="NVIDIA H100"),
        key(config_hash=config_hash({"layers": 41})),
        key(tiers=(8, 16, 24)),
        key(context_len=4096),
    ):
        assert load_table(path, other) is None
        assert other.file_name() != key().file_name()
    path.write_text("{not json")
    assert load_table(path, key()) is None
    path.write_text(json.dumps({"format": 99}))
    assert load_table(path, key()) is None


def test_load_or_profile_profiles_once_and_a_failure_is_no_table(tmp_path, caplog):
    calls = []
    table = StepTimeTable((1,), (1.0,), (8, 16), (5.0, 6.0))

    def profile():
        calls.append(1)
        return table

    assert load_or_profile(tmp_path, key(), profile) == table
    assert load_or_profile(tmp_path, key(), profile) == table
    assert len(calls) == 1

    def failing():
        raise RuntimeError("capture failed")

    with caplog.at_level(logging.WARNING):
        assert load_or_profile(tmp_path, key(tiers=(8,)), failing) is None
    assert "verify every draft" in caplog.text
