"""`/metrics` exposes the speculation counters (`dspark.md` §5.1) from the engine's totals."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncEngine, EngineConfig
from engine.client import as_client
from engine.sampling_params import SamplingParams
from engine.speculative.drafts import DraftRequests, Proposal
from engine.speculative.planner import ScheduledPlanner
from engine.speculative.step_times import StepTimeTable
from server.metrics import ServerMetrics


def _sample(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert lines, name
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_metrics_report_drafted_verified_and_accepted_tokens(tiny_model) -> None:
    config = EngineConfig(model="tiny", max_num_seqs=4, kv_cache_tokens=4096, speculative="dspark")
    engine = AsyncEngine.from_model(tiny_model, config)
    client = as_client(engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def scenario() -> None:
        await client.start()
        try:
            async for _ in client.generate([0, 5, 6, 7], params, "r0"):
                pass
        finally:
            await client.shutdown()

    asyncio.run(scenario())
    metrics = ServerMetrics("m")
    text = metrics.render(client).decode()
    spec = engine.core.runner.speculative.metrics
    # 11 decode steps after the prefill; the last may verify no draft (one token left)
    assert spec.num_request_steps == 10
    assert _sample(text, "deepinfer:spec_verify_steps_total") == spec.num_request_steps
    assert _sample(text, "deepinfer:spec_draft_tokens_total") == spec.num_drafted > 0
    assert _sample(text, "deepinfer:spec_verified_draft_tokens_total") == spec.num_verified
    assert _sample(text, "deepinfer:spec_accepted_tokens_total") == spec.num_accepted
    assert _sample(text, "deepinfer:spec_accept_length_steps") == spec.num_request_steps
    assert _sample(text, "deepinfer:spec_verified_per_pos_total") == spec.num_verified
    # a second scrape adds nothing (counters advance by the engine's new totals only)
    again = metrics.render(client).decode()
    assert _sample(again, "deepinfer:spec_draft_tokens_total") == spec.num_drafted


class ZeroConfidenceDrafts:
    """Drafts the token after the anchor with confidence 0 (survivals below every cut-off)."""

    num_drafts = 5

    def propose(self, requests: DraftRequests) -> Proposal:
        drafts = (requests.anchors[:, None] + torch.arange(1, 6)[None, :]) % 64
        return Proposal(drafts, None, torch.zeros(drafts.shape))


def _serve(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int = 12) -> str:
    client = as_client(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> None:
        async for _ in client.generate(prompt, params, f"r{i}"):
            pass

    async def scenario() -> None:
        await client.start()
        try:
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await client.shutdown()

    asyncio.run(scenario())
    return ServerMetrics("m").render(client).decode()


def _labelled(text: str, name: str, label: str) -> dict[str, float]:
    return {
        s.labels[label]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_metrics_report_planner_decisions_budgets_history_and_step_time(tiny_model) -> None:
    config = EngineConfig(model="tiny", max_num_seqs=4, kv_cache_tokens=4096, speculative="dspark")
    engine = AsyncEngine.from_model(tiny_model, config)
    tiers = tuple(range(1, 65))
    table = StepTimeTable(
        draft_buckets=(1,),
        draft_ms=(0.0,),
        verify_tiers=tiers,
        verify_ms=tuple(1.0 + m for m in tiers),
        alpha_ms=0.0,
    )
    planner = engine.core.scheduler.speculation.planner = ScheduledPlanner(table, 5)
    text = _serve(engine, [[0, 5, 6, 7], [0, 9, 3]])
    metrics = planner.metrics
    decisions = _labelled(text, "deepinfer:spec_planner_decisions_total", "reason")
    assert decisions == {k: float(v) for k, v in metrics.steps_by_reason.items()}
    assert sum(decisions.values()) >= 10
    tier_steps = _labelled(text, "deepinfer:spec_planner_tier_steps_total", "tier")
    assert tier_steps == {str(k): float(v) for k, v in metrics.steps_by_tier.items()}
    assert _sample(text, "deepinfer:spec_planner_budget_tokens_total") == metrics.budget_total
    budgets = _labelled(text, "deepinfer:spec_planner_budget_steps", "budget")
    assert sum(budgets.values()) == sum(decisions.values())
    assert sum(int(b) * n for b, n in budgets.items()) == metrics.budget_total
    # the first two decode steps of each request plan with the prior, later ones with history
    fraction = _sample(text, "deepinfer:spec_planner_no_history_fraction")
    assert 0 < fraction < 1
    assert fraction == pytest.approx(metrics.no_history_fraction)
    # every planned step's measured time reached the cost-model check
    ratios = _labelled(text, "deepinfer:spec_planner_step_time_ratio", "tier")
    assert set(ratios) == {str(t) for t in metrics.step_time.ratios}
    assert sum(metrics.step_time.counts.values()) == sum(decisions.values())
    assert all(r > 0 for r in ratios.values())


def test_a_verify_all_decision_verifies_every_cap_whatever_the_confidences(tiny_model) -> None:
    config = EngineConfig(
        model="tiny",
        max_num_seqs=4,
        kv_cache_tokens=4096,
        speculative="dspark",
        speculative_verify="fixed",
    )
    engine = AsyncEngine.from_model(tiny_model, config, draft_source=ZeroConfidenceDrafts())
    text = _serve(engine, [[0, 5, 6, 7]])
    spec = engine.core.runner.speculative.metrics
    decisions = _labelled(text, "deepinfer:spec_planner_decisions_total", "reason")
    assert decisions == {"fixed": spec.num_request_steps}
    # every request-step verifies its cap: 5 drafts while at least 6 tokens are left
    assert spec.verified_per_position[5] > 0
    assert spec.num_verified == _sample(text, "deepinfer:spec_planner_budget_tokens_total")
