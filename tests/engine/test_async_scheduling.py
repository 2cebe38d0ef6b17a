"""Async scheduling (`engine/overlap.py`): the same tokens as the synchronous loop, on `tiny`.

Each engine test runs the same jobs with `async_scheduling` on and off and compares every delta
(tokens, logprobs, finish reasons); the recorded schedules show that the async run really
scheduled decode rows with placeholders ahead of the tokens they continue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.async_engine import AsyncEngine, EngineConfig
from engine.kv_cache import CacheConfig, KVCacheManager
from engine.outputs import PLACEHOLDER_TOKEN_ID, ModelOutput, SchedulerOutput
from engine.overlap import OverlappedCore
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.structured import GrammarCompiler, GrammarSpec
from engine.thinking_budget import ThinkingBudget
from tests.engine.engine_checks import abort_mid_stream, assert_all_released

TINY_VOCAB = 1024
EOS_ID = 1


def _engine(model, async_scheduling: bool, **overrides) -> AsyncEngine:
    settings = {"max_num_seqs": 16, "kv_cache_tokens": 8192, **overrides}
    config = EngineConfig(model="tiny", async_scheduling=async_scheduling, **settings)
    return AsyncEngine.from_model(model, config)


def _record_schedules(engine: AsyncEngine) -> list[SchedulerOutput]:
    """Every `schedule()` output of the engine's scheduler, in order."""
    scheduler = engine.core.scheduler
    outputs: list[SchedulerOutput] = []
    schedule = scheduler.schedule

    def recording() -> SchedulerOutput:
        outputs.append(schedule())
        return outputs[-1]

    scheduler.schedule = recording
    return outputs


async def _deltas(engine: AsyncEngine, prompt, params, rid, constraint=None) -> list[tuple]:
    return [
        (d.index, d.token_ids, d.logprobs, d.finish_reason, d.num_output_tokens)
        async for d in engine.generate(prompt, params, rid, constraint)
    ]


def _run(engine: AsyncEngine, jobs) -> list[list[tuple]]:
    async def scenario():
        await engine.start()
        try:
            return await asyncio.gather(
                *(_deltas(engine, *job[:2], f"r{i}", *job[2:]) for i, job in enumerate(jobs))
            )
        finally:
            await engine.shutdown()

    return asyncio.run(scenario())


def _tokens(deltas: list[tuple], index: int = 0) -> list[int]:
    return [t for d in deltas if d[0] == index for t in d[1]]


def _placeholder_rows(schedules: list[SchedulerOutput]) -> int:
    return sum(c.token_ids == (PLACEHOLDER_TOKEN_ID,) for out in schedules for c in out.chunks)


@pytest.mark.slow  # ~8 s
def test_async_scheduling_gives_the_tokens_of_the_synchronous_loop(tiny_model) -> None:
    eos = tiny_model.config.eos_token_id
    jobs = [
        ([0, 5, 6, 7], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
        ([0, *range(10, 80)], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        ([0, 9, 8], SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=14)),
        ([0, 9, 8], SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=6, ignore_eos=True)),
        # EOS made likely: stops at a random step, which the async run learns one step late.
        ([0, 4, 4], SamplingParams(temperature=1.0, seed=3, logit_bias={eos: 4.0}, max_tokens=30)),
        (
            [0, 4, 4],
            SamplingParams(
                temperature=1.0,
                seed=8,
                logit_bias={77: 4.0},
                max_tokens=30,
                stop_token_ids=(77,),
                ignore_eos=True,
            ),
        ),  # fmt: skip
        (
            [0, 3, 2, 1],
            SamplingParams(
                temperature=0.7,
                seed=2,
                frequency_penalty=1.5,
                presence_penalty=0.5,
                max_tokens=10,
                ignore_eos=True,
            ),
        ),  # fmt: skip
        ([0, 12], SamplingParams(temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)),
        ([0, *range(100, 300)], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
    ]
    sync_engine = _engine(tiny_model, False, max_num_batched_tokens=64)
    async_engine = _engine(tiny_model, True, max_num_batched_tokens=64)
    schedules = _record_schedules(async_engine)
    expected = _run(sync_engine, jobs)
    got = _run(async_engine, jobs)
    assert isinstance(async_engine.core, OverlappedCore)
    assert got == expected
    assert _placeholder_rows(schedules) > 20  # decode rows ran ahead of their tokens
    assert_all_released(async_engine)
    eos_run, stop_run = got[4], got[5]
    assert _tokens(eos_run)[-1] == eos and eos_run[-1][3] is FinishReason.STOP
    assert len(_tokens(eos_run)) < 30  # it did stop early
    stops = [i for i, t in enumerate(_tokens(stop_run)) if t == 77]
    assert stops == [len(_tokens(stop_run)) - 1] and stop_run[-1][3] is FinishReason.STOP


def test_a_stopped_request_computes_at_most_one_discarded_token(tiny_model) -> None:
    """The stop id is sampled at output 0; the async run schedules output 1 before it knows,
    computes it, and emits nothing of it. Length limits are never overrun."""
    stop = SamplingParams(temperature=0, logit_bias={77: 100}, stop_token_ids=(77,))
    length = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = _engine(tiny_model, True)
    schedules = _record_schedules(engine)
    stop_run, length_run = _run(engine, [([0, 9, 8], stop), ([0, 9, 8], length)])
    assert _tokens(stop_run) == [77] and stop_run[-1][3] is FinishReason.STOP
    assert _tokens(length_run) == _tokens(
        _run(_engine(tiny_model, False), [([0, 9, 8], length)])[0]
    )
    rows = {rid: 0 for rid in ("r0", "r1")}
    for out in schedules:
        for chunk in out.chunks:
            rows[chunk.request_id] += 1
    assert rows == {"r0": 2, "r1": 4}  # r0: prompt + the discarded row; r1: no extra row
    assert_all_released(engine)


@pytest.mark.slow  # ~8 s
def test_preemption_under_async_scheduling_gives_the_same_tokens(tiny_model_exact_kv) -> None:
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    jobs = [([0, *range(5, 5 + n)], params) for n in (100, 90, 80, 70)]
    roomy = _engine(tiny_model_exact_kv, False, kv_cache_tokens=8192, max_model_len=5 * 128)
    tight = _engine(tiny_model_exact_kv, True, kv_cache_tokens=5 * 128, max_model_len=5 * 128)
    assert _run(tight, jobs) == _run(roomy, jobs)
    assert tight.core.scheduler.num_preemptions > 0
    assert_all_released(tight)


def test_aborts_mid_stream_free_everything(tiny_model) -> None:
    engine = _engine(tiny_model, True)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

    assert abort_mid_stream(engine, params) == [3, 3, 3, 3]
    assert_all_released(engine)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))


def test_grammar_requests_under_async_scheduling_stay_valid(tiny_model, tiny_tokenizer) -> None:
    tiny_compiler = GrammarCompiler.for_tokenizer(tiny_tokenizer, TINY_VOCAB, EOS_ID)
    pattern = "(tok4|tok5|tok6)(tok7|Tok8|tok9){2,5}"
    regex = tiny_compiler.constraint(GrammarSpec("regex", pattern))
    greedy = SamplingParams(temperature=0, max_tokens=30)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=30)
    penalised = SamplingParams(temperature=1.0, seed=4, max_tokens=30, frequency_penalty=2.0)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    jobs = [([0, 20 + i, 40], p, regex) for i, p in enumerate((greedy, sampled, penalised))]
    jobs += [([0, 30, 31], free)]
    expected = _run(_engine(tiny_model, False), jobs)
    engine = _engine(tiny_model, True)
    schedules = _record_schedules(engine)
    got = _run(engine, jobs)
    assert got == expected
    assert _placeholder_rows(schedules) > 10
    for deltas in got[:3]:
        tokens = _tokens(deltas)
        assert tokens[-1] == EOS_ID and deltas[-1][3] is FinishReason.STOP
        words = "".join(tiny_tokenizer.id_to_token(t) for t in tokens[:-1])
        assert re.fullmatch(pattern, words), words
    assert_all_released(engine)


# ---- the scheduler alone: two steps in flight order -------------------------------------------


def _scheduler(max_tokens: int = 3) -> tuple[Scheduler, Request]:
    cache = CacheConfig(num_blocks=8, num_slots=2, block_tokens=4)
    scheduler = Scheduler(SchedulerConfig(max_model_len=32), KVCacheManager(cache))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=(9,))
    request = Request("a", [5, 6, 7], params, seed=0, arrival_time=0.0)
    scheduler.add_request(request)
    return scheduler, request


def _sampled(token: int) -> ModelOutput:
    return ModelOutput(sampled={"a": [token]}, logprobs={})


def test_scheduler_schedules_a_placeholder_row_ahead_of_its_token() -> None:
    scheduler, request = _scheduler()
    first = scheduler.schedule()
    second = scheduler.schedule()  # before the first step's token is known
    assert first.chunks[0].token_ids == (5, 6, 7)
    (row,) = second.chunks
    assert row.token_ids == (PLACEHOLDER_TOKEN_ID,) and row.start_position == 3
    assert row.sampling.output_index == 1
    scheduler.check_integrity()
    assert scheduler.update(first, _sampled(11))[0].token_ids == [11]
    third = scheduler.schedule()  # output 2 is the last (max_tokens 3): nothing after it
    assert third.chunks[0].start_position == 4
    scheduler.check_integrity()
    assert scheduler.update(second, _sampled(12))[0].token_ids == [12]
    assert scheduler.schedule().is_empty  # the step in flight samples the last token
    final = scheduler.update(third, _sampled(13))
    assert final[0].token_ids == [13] and final[0].finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [11, 12, 13]
    scheduler.check_integrity()


def test_scheduler_drops_the_row_after_a_stop_it_learns_late() -> None:
    scheduler, request = _scheduler(max_tokens=10)
    first = scheduler.schedule()
    second = scheduler.schedule()
    (delta,) = scheduler.update(first, _sampled(9))  # the stop id
    assert delta.finish_reason is FinishReason.STOP
    assert scheduler.update(second, _sampled(4)) == []  # computed, never emitted
    assert request.output_token_ids == [9]
    scheduler.check_integrity()
    assert not scheduler.has_unfinished_requests()


def test_async_scheduling_is_off_by_default_on_the_cpu(tiny_model) -> None:
    config = EngineConfig(model="tiny", max_num_seqs=2, kv_cache_tokens=4096)
    assert not isinstance(AsyncEngine.from_model(tiny_model, config).core, OverlappedCore)


def test_a_failing_step_fails_only_its_requests_under_async_scheduling(tiny_model) -> None:
    engine = _engine(tiny_model, True)
    runner = engine.core.runner
    launch = runner.launch

    def failing(output, previous=None):  # the model raises on steps with the poisoned request
        if any(c.request_id == "poisoned" for c in output.chunks):
            raise RuntimeError("secret detail of the poisoned request")
        return launch(output, previous)

    runner.launch = failing
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    jobs = [([0, 5, 6], params), ([0, 9, 9], params), ([0, 5, 6], params)]

    async def scenario():
        await engine.start()
        try:
            first = await _deltas(engine, *jobs[0], "before")
            poisoned = await _deltas(engine, *jobs[1], "poisoned")
            after = await _deltas(engine, *jobs[2], "after")
            return first, poisoned, after
        finally:
            await engine.shutdown()

    first, poisoned, after = asyncio.run(scenario())
    assert first == after and after[-1][3] is FinishReason.LENGTH
    assert poisoned == [(0, [], None, FinishReason.ABORT, 0)]
    assert_all_released(engine)


def test_prefix_cache_hits_under_async_scheduling_give_the_same_tokens(tiny_model_exact_kv) -> None:
    """Turn 2 extends turn 1's prompt and output (the agent pattern): under async scheduling it
    hits the blocks turn 1 committed and generates what an uncached synchronous engine does."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first_prompt = [0, *[3 + (7 * i) % 900 for i in range(260)]]

    def conversation(engine: AsyncEngine) -> list[list[int]]:
        async def scenario():
            await engine.start()
            try:
                prompt, outputs = first_prompt, []
                for turn in range(2):
                    background = _deltas(engine, [0, 40 + turn], greedy, f"bg{turn}")
                    deltas, _ = await asyncio.gather(
                        _deltas(engine, prompt, greedy, f"t{turn}"), background
                    )
                    outputs.append(_tokens(deltas))
                    prompt = [*prompt, *outputs[-1], 11, 12, 13]
                return outputs
            finally:
                await engine.shutdown()

        return asyncio.run(scenario())

    uncached = _engine(tiny_model_exact_kv, False, enable_prefix_caching=False)
    cached = _engine(tiny_model_exact_kv, True, swa_replay="exact")
    assert conversation(cached) == conversation(uncached)
    assert cached.core.scheduler.prefix_reuse.stats().num_hit_tokens >= 256
    assert_all_released(cached)


def test_a_thinking_budget_under_async_scheduling_forces_the_same_token(tiny_model) -> None:
    """The budget's draw depends on whether an earlier output ended the reasoning: that row
    waits for its outputs instead of running ahead, and the tokens equal the synchronous run's
    (the forced end token exactly once, at the budget's index)."""
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = _tokens(_run(_engine(tiny_model, False), [([0, 9, 8], free)])[0])
    end = 77 if 77 not in plain else 78
    budgets = [
        ThinkingBudget(max_tokens=3, end_token_id=end),
        ThinkingBudget(max_tokens=0, end_token_id=end),
        ThinkingBudget(max_tokens=3, end_token_id=end, ended_by=(plain[1],)),  # ended by the model
    ]
    jobs = [
        ([0, 9, 8], dataclasses.replace(free, thinking_budget=budget, seed=i))
        for i, budget in enumerate(budgets)
    ]
    engine = _engine(tiny_model, True)
    schedules = _record_schedules(engine)
    got = _run(engine, jobs)
    assert got == _run(_engine(tiny_model, False), jobs)
    assert _tokens(got[0])[3] == end and _tokens(got[0]).count(end) == 1
    assert _tokens(got[1])[0] == end
    assert _tokens(got[2]) == plain
    assert _placeholder_rows(schedules) > 10
    assert_all_released(engine)
