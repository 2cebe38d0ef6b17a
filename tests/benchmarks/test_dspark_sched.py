"""The synthetic-acceptance benchmark of `dspark.md` §6 runs, and its generator is keyed."""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.dspark_sched import (
    GeneratorConfig,
    LoopConfig,
    ModelledSteps,
    SyntheticRequest,
    calibrate,
    closed_loop,
    cmd_measure,
    linear_table,
)


def test_draws_are_keyed_by_slot_and_serial_not_by_call_order():
    cfg = GeneratorConfig(seed=3)
    a, b = SyntheticRequest(cfg, 2, 5), SyntheticRequest(cfg, 2, 5)
    SyntheticRequest(cfg, 0, 0)  # another request drawn in between changes nothing
    a.pos = b.pos = 17
    assert all(np.array_equal(x, y) for x, y in zip(a.block(), b.block(), strict=True))
    other = SyntheticRequest(cfg, 2, 6)
    other.pos = 17
    assert not np.array_equal(a.block()[1], other.block()[1])


def test_modelled_scheduled_arm_gains_at_sixty_sequences():
    """The design's cost model (T = 9.88 + 0.0125·M ms) at 60 sequences: the planner verifies
    fewer drafts than fixed-5 and commits more tokens per second (§6.5: about +4 %)."""
    gen_cfg, fit, stats = calibrate(GeneratorConfig(), quick=True)
    assert abs(stats["fixed5_accept_len"] - 3.29) < 0.25
    table = linear_table(9.88, 0.0125, 360, tiered=False)
    loop = LoopConfig(60, 150)
    fixed = closed_loop("fixed", loop, gen_cfg, fit, table, ModelledSteps(table)).summary()
    sched = closed_loop("scheduled", loop, gen_cfg, fit, table, ModelledSteps(table)).summary()
    assert fixed["drafts_verified"] > 4.8 and sched["drafts_verified"] < 4.0
    assert sched["tok_s"] > 1.02 * fixed["tok_s"]
    assert sched["accept_len"] < fixed["accept_len"]


def test_measure_runs_on_the_cpu_with_the_small_config(tmp_path):
    """Real tiny-model forwards through the whole harness: table profiled and cached, both
    arms at two loads, results written."""
    args = argparse.Namespace(
        seqs=[2, 4], seed=0, out=tmp_path, steps=2, warmup=1, repeats=1, context=64,
        arms=["fixed", "scheduled"], device="cpu", small=True, eager=False,
        table_cache=tmp_path / "tables",
    )  # fmt: skip
    results = cmd_measure(args)
    assert results["mode"].startswith("measure (BENCHMARK MODE")
    assert list((tmp_path / "tables").glob("step_times_*.json"))
    for n in (2, 4):
        for arm in ("fixed", "scheduled"):
            run = results["runs"][n]["median"][arm]
            assert run["accept_len"] >= 1 and run["step_ms"] > 0
            assert n <= run["rows_per_step"] <= 6 * n
    json.dumps(results, default=str)
