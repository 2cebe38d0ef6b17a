"""`/metrics` exposes the speculation counters (`dspark.md` §5.1) from the engine's totals."""

from __future__ import annotations

import asyncio

from engine.async_engine import AsyncEngine, EngineConfig
from engine.client import as_client
from engine.sampling_params import SamplingParams
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
