"""STS calibration of the confidence head (`dspark.md` §3.7)."""

from __future__ import annotations

import asyncio
import itertools
import math
import operator
import subprocess
import sys

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampling_params import SamplingParams
from engine.speculative.drafts import DraftRequests, Proposal
from engine.speculative.records import read_records
from engine.speculative.sts import (
    StsCalibration,
    StsFit,
    confidence_logits,
    ece,
    fit_sts,
    prefix_labels,
    regime_of,
)

TRUE_T = (1.6, 1.0, 0.8, 1.25, 2.0)


def synthetic(n: int, seed: int):
    """Head logits ℓ [n, 5] whose true conditional acceptance is sigmoid(ℓ_k / T_k): raw
    confidences overconfident where T > 1. Returns (logits, prefix labels)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 5, generator=gen, dtype=torch.float64) * 2 + 2
    pi = torch.sigmoid(logits / torch.tensor(TRUE_T, dtype=torch.float64))
    passed = torch.rand(n, 5, generator=gen, dtype=torch.float64) < pi
    accepted = passed.long().cumprod(1).sum(1)
    return logits, prefix_labels(accepted, 5)


def test_ece_of_a_constant_prediction_is_its_gap():
    prob = torch.full((10,), 0.8)
    label = torch.tensor([1.0] * 5 + [0.0] * 5)
    assert ece(prob, label) == pytest.approx(0.3)
    assert ece(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == pytest.approx(0.1)


def test_prefix_labels_mark_the_accepted_prefix():
    labels = prefix_labels(torch.tensor([0, 2, 5]), 5)
    assert labels.tolist() == [[0] * 5, [1, 1, 0, 0, 0], [1] * 5]


def test_the_fit_recovers_the_temperatures_and_calibrates():
    logits, labels = synthetic(40_000, seed=0)
    fit = fit_sts(logits, labels)
    for got, want in zip(fit.temperatures, TRUE_T, strict=True):
        assert got == pytest.approx(want, rel=0.15)
    assert fit.num_samples == 40_000
    held_logits, held_labels = synthetic(40_000, seed=1)
    survivals = fit.survivals(torch.sigmoid(held_logits))
    raw = torch.sigmoid(held_logits).cumprod(1)
    for k in range(5):
        assert ece(survivals[:, k], held_labels[:, k]) < 0.015
    assert ece(raw[:, 0], held_labels[:, 0]) > 0.04  # position 1 was overconfident
    assert fit.ece_after[0] < fit.ece_before[0]


def test_calibration_keeps_the_order_and_matches_the_heads_temperature_input():
    """sigmoid(ℓ/T) is what `DSparkStages.draft(confidence_temperature=T)` computes."""
    fit = StsFit((1.5, 0.8), (0.0, 0.0), (0.0, 0.0), 1)
    logits = torch.randn(100, 2, dtype=torch.float64)
    calibrated = fit.calibrate(torch.sigmoid(logits))
    expected = torch.sigmoid(logits / torch.tensor([1.5, 0.8], dtype=torch.float64))
    assert torch.allclose(calibrated, expected, atol=1e-9)
    for k in range(2):
        assert torch.equal(logits[:, k].argsort(), calibrated[:, k].argsort())
    assert torch.allclose(confidence_logits(torch.sigmoid(logits)), logits, atol=1e-9)
    assert torch.allclose(fit.survivals(torch.sigmoid(logits)), expected.cumprod(1))


def test_a_calibration_file_round_trips_and_refuses_another_draft_count(tmp_path):
    fit = StsFit((1.1, 0.9, 1.0), (0.05, 0.04, 0.03), (0.01, 0.01, 0.01), 1000)
    calibration = StsCalibration(3, {"sampled": fit})
    path = tmp_path / "sts.json"
    calibration.save(path)
    loaded = StsCalibration.load(path, 3)
    assert loaded == calibration
    assert loaded.fit_for(1.0) == fit
    assert loaded.fit_for(0.0) == StsFit.identity(3)  # no greedy fit: identity
    with pytest.raises(ValueError, match="fitted for 3 drafts, not 5"):
        StsCalibration.load(path, 5)
    with pytest.raises(ValueError):
        StsCalibration(5, {"sampled": fit})
    with pytest.raises(ValueError):
        StsCalibration(3, {"hot": fit})


def test_regimes_follow_the_acceptance_rule():
    assert [regime_of(t) for t in (0.0, 0.3, 0.7, 1.0)] == [
        "greedy",
        "sampled_low_temp",
        "sampled",
        "sampled",
    ]


# ---------------------------------------------------------------- in the engine


class ConstantDrafts:
    """Drafts the tokens after the anchor with one raw confidence everywhere."""

    num_drafts = 5

    def __init__(self, confidence: float) -> None:
        self.confidence = confidence

    def propose(self, requests: DraftRequests) -> Proposal:
        drafts = (requests.anchors[:, None] + torch.arange(1, 6)[None, :]) % 64
        return Proposal(drafts, None, torch.full(drafts.shape, self.confidence))


def _generate(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int = 10) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> None:
        async for _ in engine.generate(prompt, params, f"r{i}"):
            pass

    async def scenario() -> None:
        await engine.start()
        try:
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def _config(**overrides) -> EngineConfig:
    settings = {"max_num_seqs": 4, "kv_cache_tokens": 4096, "speculative": "dspark"}
    return EngineConfig(model="tiny", **{**settings, **overrides})


@pytest.mark.parametrize("calibrated", [False, True])
def test_the_planner_sees_calibrated_survivals_with_a_calibration_file(
    calibrated, tiny_model, tmp_path
) -> None:
    temps = (2.0, 0.5, 1.0, 3.0, 1.5)
    path = tmp_path / "sts.json"
    StsCalibration(5, {"greedy": StsFit(temps, (0.0,) * 5, (0.0,) * 5, 100)}).save(path)
    config = _config(speculative_calibration=str(path) if calibrated else None)
    engine = AsyncEngine.from_model(tiny_model, config, draft_source=ConstantDrafts(0.9))
    _generate(engine, [[0, 5, 6, 7], [0, 9, 3]])
    # the scheduled planner (no step-time table on the CPU) folds every step's survivals into
    # its prior; constant confidences make that prior the survivals themselves
    prior = engine.core.scheduler.speculation.planner.prior
    logit = math.log(0.9 / 0.1)
    conditional = [1 / (1 + math.exp(-logit / t)) for t in temps] if calibrated else [0.9] * 5
    assert prior == pytest.approx(list(itertools.accumulate(conditional, operator.mul)))


def test_a_calibration_file_for_another_draft_count_is_a_startup_error(
    tiny_model, tmp_path
) -> None:
    path = tmp_path / "sts4.json"
    StsCalibration(4, {"greedy": StsFit.identity(4)}).save(path)
    config = _config(speculative_calibration=str(path))
    with pytest.raises(ValueError, match="fitted for 4 drafts, not 5"):
        AsyncEngine.from_model(tiny_model, config)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an STS calibration file"):
        AsyncEngine.from_model(
            tiny_model, _config(speculative_calibration=str(tmp_path / "bad.json"))
        )
    with pytest.raises(ValueError, match="need --speculative dspark"):
        EngineConfig(model="tiny", speculative="off", speculative_calibration=str(path))


def test_records_the_engine_dumps_fit_a_calibration_it_then_loads(tiny_model, tmp_path) -> None:
    records = tmp_path / "records.jsonl"
    engine = AsyncEngine.from_model(tiny_model, _config(speculative_record=str(records)))
    _generate(engine, [[0, 5, 6, 7], [0, 9, 3], [2, 4]], max_tokens=16)
    written = read_records(records)
    spec = engine.core.runner.speculative.metrics
    # the random drafter's first draft is (almost) always rejected: every request-step is
    # uncensored and recorded, with its 5 raw confidences and temperature 0
    assert len(written) == spec.num_request_steps > 20
    assert sum(r.accepted for r in written) == spec.num_accepted
    assert {len(r.confidence) for r in written} == {5} and {r.temperature for r in written} == {0}
    out = tmp_path / "sts.json"
    fit = subprocess.run(
        [sys.executable, "-m", "engine.speculative.sts", "fit", "--records", str(records)]
        + ["--out", str(out), "--min-samples", "10"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert fit.stdout.startswith("greedy: n=")
    calibration = StsCalibration.load(out, 5)
    assert set(calibration.fits) == {"greedy"}
    assert calibration.fits["greedy"].num_samples == len(written)
    # the fitted file is accepted by the engine
    AsyncEngine.from_model(tiny_model, _config(speculative_calibration=str(out)))
