"""Speculation under async scheduling (`engine/speculative/overlap.py`), on `tiny` and `default`.

Every test runs speculation with `async_scheduling=True` and compares with the synchronous
speculative loop or with decoding without speculation: tokens (greedy, and seeded sampling by
rejection and in the coupled mode), stops and lengths inside accepted runs, logprobs, `n > 1`,
grammar-constrained outputs, preemption and aborts. The recorded schedules show that the async
core really scheduled step N+1 before step N's accept counts reached the host (a decode row
with draft slots and a placeholder token).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.core import EngineCore
from engine.kv_cache import CacheConfig, KVCacheManager
from engine.outputs import PLACEHOLDER_TOKEN_ID, ModelOutput
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.speculative.overlap import OverlappedSpeculativeCore
from engine.speculative.planner import FixedPlanner
from engine.speculative.scheduling import DraftScheduling
from engine.speculative.step import DraftsAhead
from engine.thinking_budget import ThinkingBudget
from tests.engine.engine_checks import abort_mid_stream, assert_all_released
from tests.engine.speculative.history_drafts import HistoryDrafts
from tests.engine.speculative.test_interactions import (
    PREEMPTION_CASES,
    _engine,
    _outputs,
    _prompt,
    _references,
    _run,
    assert_greedy_unchanged,
    assert_in_language,
    preemption_jobs,
    record_schedules,
    regex_constraint,
)
from tests.engine.speculative.test_lossless import (
    ReferenceDrafts,
    _admit_with_references,
    _core,
    _prompts,
    _reference,
    _request,
)


def _ran_ahead(schedules) -> int:
    """Decode rows with draft slots scheduled while their previous step was in flight."""
    return sum(
        c.num_draft_slots > 0 and c.token_ids == (PLACEHOLDER_TOKEN_ID,)
        for out in schedules
        for c in out.chunks
    )


def _async_spec(model, source, **overrides):
    engine = _engine(model, source, speculative="dspark", async_scheduling=True, **overrides)
    assert isinstance(engine.core, OverlappedSpeculativeCore)
    return engine


@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_async_greedy_tokens_equal_one_token_decoding_at_every_verify_width(
    tiny_model_exact_kv, num_speculative_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long greedy generations, every commit width 1..K+1 at both parities: the async
    speculative core gives the tokens of decoding without speculation."""
    model = tiny_model_exact_kv
    prompts, max_tokens = _prompts(3), 72
    want = _reference(model, prompts, max_tokens)
    source = ReferenceDrafts(model.config.vocab_size, num_speculative_tokens)
    core = _core(
        model,
        source,
        speculative="dspark",
        num_speculative_tokens=num_speculative_tokens,
        async_scheduling=True,
    )
    assert isinstance(core, OverlappedSpeculativeCore)
    schedules = record_schedules(core.scheduler)
    selections = _record_selections(monkeypatch)
    requests = [_request(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
    _admit_with_references(core, requests, want, source)
    while core.has_work():
        core.step()
        core.scheduler.check_integrity()
    assert {r.request_id: r.output_token_ids for r in requests} == want
    lengths = core.runner.speculative.metrics.accept_length
    assert all(lengths[a] > 0 for a in range(1, num_speculative_tokens + 2)), lengths
    assert _ran_ahead(schedules) > 20
    # Every step's drafts were queued before the step was resolved, and matched its rows.
    assert len(selections) > 20 and all(selections)


def _record_selections(monkeypatch) -> list[bool]:
    """Whether each `DraftsAhead.select` found the rows its step drafts."""
    found: list[bool] = []
    select = DraftsAhead.select

    def recording(self, rows):
        proposal = select(self, rows)
        found.append(proposal is not None)
        return proposal

    monkeypatch.setattr(DraftsAhead, "select", recording)
    return found


@pytest.mark.slow  # the `default` model, ~8 s
def test_async_default_model_greedy_tokens_equal_one_token_decoding(
    default_model_exact_kv,
) -> None:
    """The `default` structure (128-token window, its rings wrapped): the same tokens."""
    model = default_model_exact_kv
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 120000, (n,), generator=g).tolist() for n in (127, 130)]
    max_tokens = 40
    want = _reference(model, prompts, max_tokens)
    source = ReferenceDrafts(model.config.vocab_size, 5)
    core = _core(model, source, speculative="dspark", async_scheduling=True)
    requests = [_request(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
    _admit_with_references(core, requests, want, source)
    while core.has_work():
        core.step()
    assert {r.request_id: r.output_token_ids for r in requests} == want
    assert core.runner.speculative.metrics.num_accepted > 0


def test_async_speculation_deltas_equal_the_synchronous_speculative_loop(
    tiny_model_exact_kv,
) -> None:
    """Seeded sampling by rejection with n = 2, a stop id and max_tokens inside accepted runs,
    logprobs, greedy rows, a penalised row and a thinking budget: every delta (tokens,
    logprobs, finish reason) of the async core equals the synchronous speculative loop's;
    stops learnt at the verdict emit nothing after them and max_tokens is never overshot."""
    model = tiny_model_exact_kv
    free = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    probe = _run(_engine(model), [(_prompt(9), free)])[0]
    stop_at = _outputs(probe)[0][37]
    sampled = SamplingParams(temperature=0.9, top_k=30, seed=4, n=2, max_tokens=40)
    jobs = [
        (_prompt(9), SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=(stop_at,))),
        (_prompt(12), SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)),
        (_prompt(7), SamplingParams(temperature=0.0, max_tokens=31, logprobs=True, top_logprobs=2)),
        (_prompt(10), sampled),
        (_prompt(13), SamplingParams(temperature=0.7, seed=9, max_tokens=33, ignore_eos=True)),
        (
            _prompt(8),
            SamplingParams(temperature=0.7, seed=2, frequency_penalty=1.5, max_tokens=10),
        ),
        (
            _prompt(11),
            SamplingParams(
                temperature=0.0,
                max_tokens=30,
                ignore_eos=True,
                thinking_budget=ThinkingBudget(max_tokens=17, end_token_id=77),
            ),
        ),
    ]
    plain = _run(_engine(model), jobs)
    refs = _references([(job[0], d) for job, d in zip(jobs, plain, strict=True)])
    vocab = model.config.vocab_size
    sync = _run(_engine(model, HistoryDrafts(vocab, refs), speculative="dspark"), jobs)
    engine = _async_spec(model, HistoryDrafts(vocab, refs))
    schedules = record_schedules(engine.core.scheduler)
    got = _run(engine, jobs)
    assert got == sync
    for i in (0, 1, 2):  # greedy: also the tokens without speculation
        assert _outputs(got[i]) == _outputs(plain[i])
    assert len(_outputs(got[1])[0]) == 23 and len(_outputs(got[2])[0]) == 31
    assert _outputs(got[0])[0][-1] == stop_at and got[0][-1][3] == "stop"
    assert _outputs(got[6])[0][17] == 77  # the budget's forced draw, after accepted runs
    assert engine.core.runner.speculative.metrics.num_accepted > 0
    assert max(len(d[1]) for run in got for d in run) > 1
    assert _ran_ahead(schedules) > 20
    assert_all_released(engine)


def test_async_block_verification_equals_the_synchronous_speculative_loop(
    tiny_model_exact_kv,
) -> None:
    """Block verification of seeded sampled rows (n = 2) under async scheduling: the deltas of
    the synchronous speculative loop."""
    model = tiny_model_exact_kv
    params = SamplingParams(temperature=0.3, top_k=30, seed=6, n=2, max_tokens=30)
    jobs = [(_prompt(9), params), (_prompt(12), params)]
    plain = _run(_engine(model), jobs)
    refs = _references([(job[0], d) for job, d in zip(jobs, plain, strict=True)])
    vocab = model.config.vocab_size
    block = {"speculative_acceptance": "block"}
    sync = _run(_engine(model, HistoryDrafts(vocab, refs), speculative="dspark", **block), jobs)
    engine = _async_spec(model, HistoryDrafts(vocab, refs), **block)
    assert _run(engine, jobs) == sync
    assert engine.core.runner.speculative.metrics.num_accepted > 0
    assert_all_released(engine)


def test_async_coupled_sampling_equals_non_speculative_bits(tiny_model_exact_kv) -> None:
    """The coupled mode with async scheduling: seeded n = 3 outputs equal decoding without
    speculation token for token, with the product drafter and with accepting drafts."""
    model = tiny_model_exact_kv
    params = SamplingParams(temperature=0.8, top_k=20, seed=5, n=3, max_tokens=40, ignore_eos=True)
    jobs = [(_prompt(10), params), (_prompt(13), params)]
    want = _run(_engine(model), jobs)
    refs = _references([(job[0], d) for job, d in zip(jobs, want, strict=True)])
    engine = _async_spec(
        model, HistoryDrafts(model.config.vocab_size, refs), speculative_acceptance="coupled"
    )
    assert [_outputs(r) for r in _run(engine, jobs)] == [_outputs(r) for r in want]
    assert engine.core.runner.speculative.metrics.num_accepted > 0
    assert_all_released(engine)
    product = _engine(
        model, speculative="dspark", speculative_acceptance="coupled", async_scheduling=True
    )
    assert [_outputs(r) for r in _run(product, jobs)] == [_outputs(r) for r in want]


def test_async_grammar_constrained_outputs_stay_valid(tiny_model_exact_kv, tiny_checkpoint) -> None:
    """Regex-constrained requests (greedy, sampled, penalised) under async speculation: the
    same deltas as the synchronous speculative loop, every output in the language."""
    model = tiny_model_exact_kv
    pattern = "(tok4|tok5|tok6)(tok7|Tok8|tok9|tok1[0-9]){6,12}"
    tokenizer, regex = regex_constraint(tiny_checkpoint, model.config.vocab_size, pattern)
    greedy = SamplingParams(temperature=0, max_tokens=30)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=30)
    penalised = SamplingParams(temperature=1.0, seed=4, max_tokens=30, frequency_penalty=2.0)
    jobs = [([0, 20 + i, 40], p, regex) for i, p in enumerate((greedy, sampled, penalised))]
    jobs += [([0, 30, 31], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    plain = _run(_engine(model), jobs)
    refs = _references([(job[0], d) for job, d in zip(jobs, plain, strict=True)])
    vocab = model.config.vocab_size
    sync = _run(_engine(model, HistoryDrafts(vocab, refs), speculative="dspark"), jobs)
    engine = _async_spec(model, HistoryDrafts(vocab, refs))
    got = _run(engine, jobs)
    assert got == sync
    assert engine.core.runner.speculative.metrics.num_accepted > 0
    for deltas in got[:3]:
        tokens = _outputs(deltas)[0]
        assert deltas[-1][3] == "stop"
        assert_in_language(tokenizer, pattern, tokens)
    assert_all_released(engine)


def test_async_grammar_requests_preempted_while_in_flight_stay_valid(
    tiny_model_exact_kv, tiny_checkpoint
) -> None:
    """Constrained requests in a pool too small for all of them: a request preempted while
    its verify step is in flight loses that step's tokens, and its matcher resumes from the
    committed outputs; outputs equal the run without speculation and stay in the language."""
    model = tiny_model_exact_kv
    pattern = "(tok4|tok5|tok6)(tok7|Tok8|tok9|tok1[0-9]){10,16}"
    tokenizer, regex = regex_constraint(tiny_checkpoint, model.config.vocab_size, pattern)
    params = SamplingParams(temperature=0, max_tokens=30)
    jobs = [(_prompt(n, salt=2), params, regex) for n in (122, 120, 118, 116)]
    tight = {"kv_cache_tokens": 5 * 128, "max_model_len": 5 * 128}
    plain = _run(_engine(model, max_model_len=5 * 128), jobs)
    refs = _references([(job[0], d) for job, d in zip(jobs, plain, strict=True)])
    engine = _async_spec(model, HistoryDrafts(model.config.vocab_size, refs), **tight)
    got = _run(engine, jobs)
    assert engine.core.scheduler.num_preemptions > 0
    assert [_outputs(r) for r in got] == [_outputs(r) for r in plain]
    for deltas in got:
        assert_in_language(tokenizer, pattern, _outputs(deltas)[0])
    assert_all_released(engine)


def test_async_preemption_and_chunked_prefill_beside_verify_rows(tiny_model_exact_kv) -> None:
    """A pool too small for every request (preemption while a step is in flight) and a token
    budget that chunks prefills beside verify rows: the greedy tokens are unchanged."""
    model = tiny_model_exact_kv
    jobs, want, refs = preemption_jobs(model)
    for overrides, preempts in PREEMPTION_CASES:
        engine = _async_spec(model, HistoryDrafts(model.config.vocab_size, refs), **overrides)
        assert_greedy_unchanged(engine, _run(engine, jobs), want, preempts)


def test_async_aborts_mid_flight_free_everything(tiny_model_exact_kv) -> None:
    """Streams closed while their next step is in flight (and a prefill cancelled): every
    block, slot and matcher is freed."""
    model = tiny_model_exact_kv
    engine = _async_spec(model, None)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

    assert all(count >= 3 for count in abort_mid_stream(engine, params))
    assert engine.core.runner.speculative.metrics.num_request_steps > 0
    assert_all_released(engine)


def test_the_cpu_default_stays_synchronous_with_speculation(tiny_model_exact_kv) -> None:
    """On the CPU async scheduling stays off unless asked, with speculation as without."""
    assert type(_engine(tiny_model_exact_kv, speculative="dspark").core) is EngineCore


def test_a_failing_step_fails_only_its_requests_under_async_speculation(
    tiny_model_exact_kv,
) -> None:
    """A step that raises at launch fails its own requests (no exception text leaks), and
    the engine serves the next requests with the tokens it gave before."""
    engine = _async_spec(tiny_model_exact_kv, None)
    speculative = engine.core.speculative
    launch = speculative.launch

    def failing(runner, output, ahead=None):
        if any(c.request_id == "poisoned" for c in output.chunks):
            raise RuntimeError("secret detail of the poisoned request")
        return launch(runner, output, ahead)

    speculative.launch = failing
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def one(prompt, rid):
        return [
            (d.token_ids, d.finish_reason, d.error)
            async for d in engine.generate(prompt, params, rid)
        ]

    async def scenario():
        await engine.start()
        try:
            return [
                await one(p, rid)
                for p, rid in (([0, 5, 6], "a"), ([0, 9], "poisoned"), ([0, 5, 6], "b"))
            ]
        finally:
            await engine.shutdown()

    first, poisoned, after = asyncio.run(scenario())
    assert first == after and after[-1][1] == "length"
    assert [(tokens, reason) for tokens, reason, _ in poisoned] == [([], "abort")]
    assert "secret" not in poisoned[0][2]
    assert_all_released(engine)


# ---- the scheduler alone: a verify row scheduled behind a verify step in flight ---------------


def _speculative_scheduler() -> Scheduler:
    cache = CacheConfig(num_blocks=16, num_slots=2, block_tokens=4)
    return Scheduler(
        SchedulerConfig(max_model_len=64),
        KVCacheManager(cache),
        speculation=DraftScheduling(3, FixedPlanner()),
    )


def _add(scheduler: Scheduler, rid: str, **params) -> Request:
    sampling = SamplingParams(temperature=0, **params)
    request = Request(rid, [5, 6, 7], sampling, seed=0, arrival_time=0.0)
    scheduler.add_request(request)
    return request


def test_a_row_behind_a_verify_step_is_placed_on_what_that_step_committed() -> None:
    """Scheduled while the step before it is in flight, a decode row starts at the lowest
    position (no draft accepted), its cap and blocks are bounds; `resolve` moves it to the
    committed length with the real anchor, the exact output index and a cap that never
    overshoots max_tokens."""
    scheduler = _speculative_scheduler()
    request = _add(scheduler, "a", max_tokens=6, ignore_eos=True)
    prefill = scheduler.schedule()
    scheduler.update(prefill, ModelOutput(sampled={"a": [11]}, logprobs={}))
    verify = scheduler.schedule()
    (row,) = verify.chunks
    assert (row.start_position, row.token_ids, row.num_draft_slots) == (3, (11,), 3)
    ahead = scheduler.schedule()  # before `verify`'s accept count is known
    (behind,) = ahead.chunks
    assert behind.start_position == 4 and behind.token_ids == (PLACEHOLDER_TOKEN_ID,)
    assert behind.num_draft_slots == 3  # from at least 2 outputs: 6 − 2 − 1
    assert len(behind.block_table) * 4 >= 4 + 3 + 1 + 3  # the furthest position it can reach
    scheduler.check_integrity()
    scheduler.update(verify, ModelOutput(sampled={"a": [12, 13, 14]}, logprobs={}))
    resolved = scheduler.resolve(ahead)
    (placed,) = resolved.chunks
    assert (placed.start_position, placed.token_ids, placed.num_draft_slots) == (6, (14,), 1)
    assert placed.sampling.output_index == 4
    scheduler.check_integrity()
    (delta,) = scheduler.update(resolved, _sampled("a", [15, 16]))
    assert delta.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [11, 12, 13, 14, 15, 16]
    scheduler.check_integrity()
    assert not scheduler.has_unfinished_requests()


def test_resolve_drops_the_rows_of_requests_the_step_before_finished() -> None:
    """A stop id inside the accepted run, or max_tokens reached by it: the row scheduled
    behind is never run (and nothing leaks)."""
    scheduler = _speculative_scheduler()
    _add(scheduler, "stop", max_tokens=20, stop_token_ids=(9,))
    _add(scheduler, "length", max_tokens=4, ignore_eos=True)
    prefill = scheduler.schedule()
    scheduler.update(prefill, _sampled("stop", [11], "length", [11]))
    verify = scheduler.schedule()
    ahead = scheduler.schedule()
    assert {c.request_id for c in ahead.chunks} == {"stop", "length"}
    deltas = scheduler.update(verify, _sampled("stop", [12, 9, 13], "length", [12, 13, 14]))
    assert [d.token_ids for d in deltas] == [[12, 9], [12, 13, 14]]
    assert scheduler.resolve(ahead).is_empty
    scheduler.check_integrity()
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_manager.num_free_blocks == 16


def _sampled(*pairs) -> ModelOutput:
    return ModelOutput(sampled=dict(zip(pairs[::2], pairs[1::2], strict=True)), logprobs={})
