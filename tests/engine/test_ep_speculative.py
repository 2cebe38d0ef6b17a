"""Expert parallelism with speculation: `MultiProcessEngine` (`--ep 2 --device cpu`, two gloo
ranks) with `--speculative dspark` gives the greedy tokens of one-token decoding (an in-process
engine with speculation off on the same `tiny` weights).

Each rank drafts with the DSpark drafter (held whole by every rank: its MoE runs locally) and
verifies 1 + L rows per request of its own, so the ranks' verify forwards differ in row counts
and must still pair their MoE collectives (`dspark.md` §4.8): one target pass per agreed step.
Exact KV storage on both sides keeps greedy tokens batch-invariant (see
`tests/engine/speculative/test_lossless.py`). The prompts differ in length, so one rank also
prefills while the other verifies.

The DSpark drafter on random weights almost never agrees with the target, so those runs commit
one token per step. `test_ep2_multi_token_commits_give_the_greedy_tokens_of_one_token_decoding`
injects `HistoryDrafts` into both ranks (`MultiProcessEngine(drafts=...)`, a picklable factory
each rank calls over its model and state): the reference continuation with one wrong draft at a
position-chosen index, so steps commit 1..6 tokens on both ranks, each verify row's acceptance
still decided by the ranks' target logits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import pytest

from engine.async_engine import AsyncEngine, EngineConfig
from engine.distributed.config import ParallelConfig
from engine.distributed.multiprocess import MultiProcessEngine
from engine.models import load_model
from engine.models.embedded import resolve_model_source
from engine.sampling_params import SamplingParams
from tests.engine.speculative.history_drafts import history_drafts

pytestmark = pytest.mark.slow  # spawns two gloo rank processes per test
ENGINE = EngineConfig(
    model="tiny",
    max_num_seqs=4,
    max_num_batched_tokens=512,
    kv_cache_tokens=4096,
    max_model_len=1024,
    kv_storage="exact",
    enable_prefix_caching=False,
)
PROMPTS = [[5 + i, 17, 3 * i + 2, *range(40, 40 + 7 * i)] for i in range(5)]
MAX_TOKENS = 40


def _generate(engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in engine.generate(prompt, params, f"r{i}"):
            assert delta.error is None, delta.error
            tokens.extend(delta.token_ids)
        return tokens

    async def scenario() -> list[list[int]]:
        await engine.start()
        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.shutdown()

    return asyncio.run(scenario())


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    config = dataclasses.replace(ENGINE, speculative="off")
    model = load_model(resolve_model_source("tiny"), numerics=config.numerics)
    return _generate(AsyncEngine.from_model(model, config), PROMPTS)


@pytest.mark.parametrize("verify", ["fixed", "scheduled"])
def test_ep2_with_speculation_gives_the_greedy_tokens_of_one_token_decoding(
    verify, reference
) -> None:
    config = dataclasses.replace(ENGINE, speculative="dspark", speculative_verify=verify)
    engine = MultiProcessEngine(config, ParallelConfig(ep_size=2, timeout_s=30.0))
    got = _generate(engine, PROMPTS)
    assert got == reference
    assert all(len(tokens) == MAX_TOKENS for tokens in got)
    ranks = engine.snapshot().ranks
    verified = [r.speculative.num_verified for r in ranks]
    assert all(v > 0 for v in verified), verified  # both ranks ran verify rows


def test_ep2_multi_token_commits_give_the_greedy_tokens_of_one_token_decoding(reference) -> None:
    config = dataclasses.replace(ENGINE, speculative="dspark")
    references = [p + t for p, t in zip(PROMPTS, reference, strict=True)]
    engine = MultiProcessEngine(
        config,
        ParallelConfig(ep_size=2, timeout_s=30.0),
        drafts=functools.partial(history_drafts, references),
    )
    assert _generate(engine, PROMPTS) == reference
    ranks = [r.speculative for r in engine.snapshot().ranks]
    # accept_length[a + 1]: request-steps that committed a + 1 tokens (a drafts accepted).
    assert all(sum(m.accept_length[2:]) > 0 for m in ranks), [m.accept_length for m in ranks]
    widths = {w for m in ranks for w, n in enumerate(m.accept_length) if n}
    assert widths == {1, 2, 3, 4, 5, 6}, [m.accept_length for m in ranks]
