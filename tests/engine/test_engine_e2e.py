"""The async engine end to end on the `tiny` model: batching, preemption, seeds, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineClosedError, EngineConfig, RequestRejectedError
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.thinking_budget import ThinkingBudget
from tests.engine.engine_checks import assert_all_released


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (count,), generator=g).tolist()
    return [[0] + torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


async def _collect(engine: AsyncEngine, prompt, params, rid) -> tuple[dict, dict]:
    tokens: dict[int, list[int]] = {}
    finish: dict[int, FinishReason] = {}
    async for delta in engine.generate(prompt, params, rid):
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
        assert delta.num_output_tokens == len(tokens[delta.index])
        if delta.finish_reason is not None:
            finish[delta.index] = delta.finish_reason
    return tokens, finish


def _engine(model, **overrides) -> AsyncEngine:
    config = EngineConfig(
        model="tiny", **{"max_num_seqs": 32, "kv_cache_tokens": 32768, **overrides}
    )
    return AsyncEngine.from_model(model, config)


async def _run_all(engine: AsyncEngine, jobs: list[tuple[list[int], SamplingParams]]):
    await engine.start()
    try:
        return await asyncio.gather(
            *(_collect(engine, p, params, f"r{i}") for i, (p, params) in enumerate(jobs))
        )
    finally:
        await engine.shutdown()


@pytest.mark.slow  # 33 engine runs, ~10-18 s
def test_concurrent_greedy_requests_match_running_alone(tiny_model_exact_kv) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(32)
    engine = _engine(tiny_model_exact_kv, max_num_batched_tokens=512)
    together = asyncio.run(_run_all(engine, [(p, greedy) for p in prompts]))
    assert_all_released(engine)
    assert engine.step_count > 12  # prompts were chunked and batched with decodes
    for prompt, (tokens, finish) in zip(prompts, together, strict=True):
        alone_engine = _engine(tiny_model_exact_kv, max_num_seqs=1)
        alone = asyncio.run(_run_all(alone_engine, [(prompt, greedy)]))[0]
        assert tokens[0] == alone[0][0]
        assert len(tokens[0]) == 12 and finish[0] is FinishReason.LENGTH


def test_preempted_request_produces_the_same_tokens(tiny_model_exact_kv) -> None:
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    prompts = [[0] + list(range(5, 5 + n)) for n in (100, 90, 80, 70)]
    roomy = _engine(tiny_model_exact_kv, max_model_len=5 * 128)
    reference = asyncio.run(_run_all(roomy, [(p, params) for p in prompts]))
    # 5 blocks of 128 tokens for four sequences growing to 140 tokens: someone gets preempted.
    tight = _engine(tiny_model_exact_kv, kv_cache_tokens=5 * 128, max_model_len=5 * 128)
    squeezed = asyncio.run(_run_all(tight, [(p, params) for p in prompts]))
    assert tight.core.scheduler.num_preemptions > 0
    assert squeezed == reference
    assert_all_released(tight)


def test_seeded_sampling_is_reproducible_across_batches(tiny_model) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    prompt = [0, 11, 12, 13, 14]
    alone = asyncio.run(_run_all(_engine(tiny_model), [(prompt, params)]))[0]
    crowd = [(p, SamplingParams(temperature=1.0, max_tokens=8)) for p in _prompts(6, seed=3)]
    crowded = asyncio.run(_run_all(_engine(tiny_model), [*crowd, (prompt, params)]))[-1]
    assert alone == crowded
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10, ignore_eos=True)
    assert asyncio.run(_run_all(_engine(tiny_model), [(prompt, other)]))[0] != alone


def test_n_choices_differ_and_are_indexed(tiny_model) -> None:
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=6, ignore_eos=True)
    tokens, finish = asyncio.run(_run_all(_engine(tiny_model), [([0, 1, 2, 3], params)]))[0]
    assert sorted(tokens) == [0, 1, 2] and sorted(finish) == [0, 1, 2]
    assert len({tuple(t) for t in tokens.values()}) > 1


def test_cancelling_a_stream_frees_everything(tiny_model) -> None:
    engine = _engine(tiny_model)

    async def scenario() -> None:
        await engine.start()
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        long_prompt = [0] + list(range(3, 600))
        waiting = engine.generate(long_prompt, params, "mid-prefill")
        decoding = engine.generate([0, 5, 6], params, "decoding")
        await decoding.__anext__()
        await decoding.__anext__()
        task = asyncio.create_task(waiting.__anext__())
        await asyncio.sleep(0)
        task.cancel()
        await decoding.aclose()
        with pytest.raises(asyncio.CancelledError):
            await task
        await waiting.aclose()
        await engine.shutdown()

    asyncio.run(scenario())
    assert_all_released(engine)


def test_shutdown_refuses_new_requests(tiny_model) -> None:
    engine = _engine(tiny_model)

    async def scenario() -> None:
        await engine.start()
        await engine.shutdown()
        with pytest.raises(EngineClosedError):
            async for _ in engine.generate([0, 1], SamplingParams(max_tokens=1), "late"):
                pass

    asyncio.run(scenario())


def test_impossible_request_is_rejected_not_left_waiting(tiny_model) -> None:
    engine = _engine(tiny_model, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=10)
    tokens, finish = asyncio.run(_run_all(engine, [(list(range(100)), params)]))[0]
    assert finish == {0: FinishReason.ABORT} and tokens[0] == []
    assert_all_released(engine)


def test_check_request_refuses_before_streaming_what_the_scheduler_would_reject(
    tiny_model,
) -> None:
    engine = _engine(tiny_model, max_model_len=64)
    too_long = SamplingParams(temperature=0, max_tokens=10)
    with pytest.raises(RequestRejectedError, match="exceeds the context length"):
        engine.check_request(list(range(100)), too_long)
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.check_request([], too_long)
    engine.check_request(list(range(50)), too_long)  # fits: no error
    tokens, finish = asyncio.run(_run_all(engine, [(list(range(50)), too_long)]))[0]
    assert finish == {0: FinishReason.LENGTH} and len(tokens[0]) == 10


def test_event_loop_stays_responsive_during_a_long_prefill(tiny_model) -> None:
    engine = _engine(tiny_model, max_num_batched_tokens=4096)
    lags: list[float] = []

    async def probe(stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t0 - 0.005)

    async def scenario() -> float:
        await engine.start()
        stop = asyncio.Event()
        prober = asyncio.create_task(probe(stop))
        t0 = time.perf_counter()
        prompt = [0] + [3 + i % 990 for i in range(3000)]
        async for _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1), "p"):
            pass
        elapsed = time.perf_counter() - t0
        stop.set()
        await prober
        await engine.shutdown()
        return elapsed

    elapsed = asyncio.run(scenario())
    assert elapsed > 0.2  # the prefill took real time ...
    assert max(lags) < 0.1  # ... and the loop kept ticking


def test_min_tokens_stop_ids_and_logprobs(tiny_model) -> None:
    eos = tiny_model.config.eos_token_id
    forced_eos = SamplingParams(temperature=1.0, seed=3, logit_bias={eos: 100}, min_tokens=3)
    stop_id = SamplingParams(temperature=0, logit_bias={77: 100}, stop_token_ids=(77,))
    with_lp = SamplingParams(temperature=0, max_tokens=4, logprobs=True, top_logprobs=5)
    jobs = [([0, 9, 8], forced_eos), ([0, 9, 8], stop_id), ([0, 9, 8], with_lp)]

    async def scenario():
        engine = _engine(tiny_model)
        await engine.start()
        out = []
        for i, (prompt, params) in enumerate(jobs):
            deltas = [d async for d in engine.generate(prompt, params, f"j{i}")]
            out.append(deltas)
        await engine.shutdown()
        return out

    eos_run, stop_run, lp_run = asyncio.run(scenario())
    eos_tokens = [t for d in eos_run for t in d.token_ids]
    assert eos_tokens[3] == eos and eos not in eos_tokens[:3] and len(eos_tokens) == 4
    assert eos_run[-1].finish_reason is FinishReason.STOP
    assert [t for d in stop_run for t in d.token_ids] == [77]
    assert stop_run[-1].finish_reason is FinishReason.STOP
    entries = [lp for d in lp_run for lp in (d.logprobs or [])]
    tokens = [t for d in lp_run for t in d.token_ids]
    assert [e.token_id for e in entries] == tokens and len(tokens) == 4
    for entry in entries:
        assert len(entry.top) == 5 and entry.top[0][0] == entry.token_id  # greedy = best
        assert entry.logprob == entry.top[0][1] <= 0
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:], strict=False))


def test_shutdown_without_drain_aborts_in_flight_requests(tiny_model) -> None:
    engine = _engine(tiny_model)

    async def scenario() -> list:
        await engine.start()
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        stream = engine.generate([0, 4, 5], params, "long")
        first = await stream.__anext__()
        await engine.shutdown(drain=False)
        rest = [d async for d in stream]
        return [first, *rest]

    deltas = asyncio.run(scenario())
    assert deltas[-1].finish_reason is FinishReason.ABORT
    assert deltas[-1].num_output_tokens < 10_000
    assert_all_released(engine)


def test_a_cache_smaller_than_the_context_is_refused_at_startup(tiny_model) -> None:
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        _engine(tiny_model, kv_cache_tokens=1024, max_model_len=4096)


def test_a_request_with_an_out_of_vocabulary_id_fails_alone(tiny_model) -> None:
    vocab = tiny_model.config.vocab_size
    engine = _engine(tiny_model)
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = asyncio.run(_run_all(_engine(tiny_model), [([0, 5, 6], good)]))[0]

    async def scenario():
        await engine.start()
        try:
            jobs = [
                _collect(engine, [0, 5, 6], good, "good"),
                _failure(engine, [0, 7], SamplingParams(max_tokens=4, logit_bias={vocab: 1.0})),
                _failure(engine, [0, vocab + 3], SamplingParams(max_tokens=4), "bad-prompt"),
            ]
            return await asyncio.gather(*jobs)
        finally:
            await engine.shutdown()

    (tokens, finish), bias_error, prompt_error = asyncio.run(scenario())
    assert (tokens, finish) == alone and finish == {0: FinishReason.LENGTH}
    assert bias_error.startswith("logit_bias: token id 1024 is outside the vocabulary")
    assert prompt_error.startswith("prompt token ids: token id 1027")
    assert_all_released(engine)


async def _failure(engine, prompt, params, rid="bad-bias") -> str:
    async for delta in engine.generate(prompt, params, rid):
        if delta.finish_reason is not None:
            assert delta.finish_reason is FinishReason.ABORT and not delta.token_ids
            return delta.error
    raise AssertionError("no final delta")


def test_a_failing_step_fails_only_its_requests_without_their_exception_text(tiny_model) -> None:
    engine = _engine(tiny_model)
    runner = engine.core.runner
    execute = runner.execute

    def failing(output):  # the model raises on steps that carry the poisoned request
        if any(c.request_id == "poisoned" for c in output.chunks):
            raise RuntimeError("secret detail of the poisoned request")
        return execute(output)

    runner.execute = failing
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def scenario():
        await engine.start()
        try:
            first = await _collect(engine, [0, 5, 6], params, "before")
            error = await _failure(engine, [0, 9, 9], params, "poisoned")
            after = await _collect(engine, [0, 5, 6], params, "after")
            return first, error, after
        finally:
            await engine.shutdown()

    first, error, after = asyncio.run(scenario())
    assert first == after and after[1] == {0: FinishReason.LENGTH}
    assert "poisoned" in error and "secret" not in error
    assert_all_released(engine)


def test_an_aborted_long_prefill_stops_within_one_chunk(tiny_model) -> None:
    # A 4,000-token prompt in one step takes seconds on the tiny model; with a 300 ms target the
    # prefill runs in short chunks, so a request sent after the abort is served within a bound.
    engine = _engine(tiny_model, target_step_ms=300)
    computed: list[int] = []
    update = engine.core.scheduler.update

    def recording_update(scheduled, model_output):
        computed.extend(len(c.token_ids) for c in scheduled.chunks if c.request_id == "long")
        return update(scheduled, model_output)

    engine.core.scheduler.update = recording_update
    long_prompt = [0] + [3 + i % 990 for i in range(4000)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def scenario() -> float:
        await engine.start()
        try:
            stream = engine.generate(long_prompt, SamplingParams(max_tokens=1), "long")
            task = asyncio.create_task(stream.__anext__())
            while engine.step_count < 2:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await stream.aclose()  # the client left: the engine aborts the request
            num_at_abort = len(computed)
            t0 = time.perf_counter()
            await _collect(engine, [0, 5, 6], params, "short")
            assert len(computed) <= num_at_abort + 1  # at most the chunk already running
            return time.perf_counter() - t0
        finally:
            await engine.shutdown()

    elapsed = asyncio.run(scenario())
    assert sum(computed) < len(long_prompt) and max(computed) < 1000
    assert elapsed < 3.0
    assert_all_released(engine)


def test_a_spent_thinking_budget_forces_the_end_token(tiny_model) -> None:
    prompt = [0, 9, 8]

    def run(budget: ThinkingBudget | None) -> list[int]:
        params = SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, thinking_budget=budget
        )
        tokens, _ = asyncio.run(_run_all(_engine(tiny_model), [(prompt, params)]))[0]
        return tokens[0]

    free = run(None)
    end = next(t for t in range(3, 1000) if t not in free)
    forced = run(ThinkingBudget(max_tokens=3, end_token_id=end))
    assert forced[:3] == free[:3] and forced[3] == end and len(forced) == 8
    assert run(ThinkingBudget(max_tokens=0, end_token_id=end))[0] == end
    # The reasoning already ended (by the end token, or a token that ends it too): no forcing.
    assert run(ThinkingBudget(max_tokens=3, end_token_id=free[1])) == free
    assert run(ThinkingBudget(max_tokens=3, end_token_id=end, ended_by=(free[2],))) == free
