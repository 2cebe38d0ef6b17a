"""Speculation with the rest of the engine (`dspark.md` §4, §5.2 tests 4, 5, 7), on `tiny`.

Drafts come from `HistoryDrafts` (`history_drafts.py`): each request's continuation in a run
without speculation, found by the request's last committed tokens and its anchor, with one wrong
draft at a position-chosen index; a request whose history matches no continuation gets drafts
that are rejected. The verify, acceptance and commit path is the product's. Exact KV
storage: token equality needs batch-invariant numerics (see `test_lossless.py`).
"""

from __future__ import annotations

import asyncio
import math
import re

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampler import counter_hash, gumbel_from_hash, noise_keys
from engine.sampling_params import SamplingParams
from engine.speculative.drafts import DraftRequests, Proposal
from tests.engine.engine_checks import assert_all_released
from tests.engine.speculative.history_drafts import HistoryDrafts


class MixtureDrafts(HistoryDrafts):
    """Sampled drafts: q = 0.6 on `HistoryDrafts`' token + 0.4 uniform, drawn with the
    request's draft noise (seeds and purpose as the engine passes them), so the verified q is
    not one-hot and block verification's weights reach the residual."""

    def propose(self, requests: DraftRequests) -> Proposal:
        centers = super().propose(requests).drafts
        vocab = torch.arange(self.vocab_size)
        logq = torch.full((*centers.shape, self.vocab_size), math.log(0.4 / self.vocab_size))
        logq.scatter_(2, centers[..., None], math.log(0.6 + 0.4 / self.vocab_size))
        drafts = torch.empty_like(centers)
        for s in range(self.num_drafts):
            keys = noise_keys(requests.seeds, requests.positions + s + 1, requests.purpose)
            drawn = (logq[:, s] + gumbel_from_hash(counter_hash(keys, vocab))).argmax(-1)
            sampled = torch.tensor(requests.is_sampled)
            drafts[:, s] = torch.where(sampled, drawn, centers[:, s])
        return Proposal(drafts, logq, torch.full(drafts.shape, 0.5))


def _engine(model, draft_source=None, **overrides) -> AsyncEngine:
    settings = {"max_num_seqs": 16, "kv_cache_tokens": 8192, **overrides}
    engine = AsyncEngine.from_model(
        model, EngineConfig(model="tiny", **settings), draft_source=draft_source
    )
    if draft_source is not None:
        draft_source.state = engine.core.runner.state
    return engine


def _run(engine: AsyncEngine, jobs) -> list[list[tuple]]:
    """Each job (prompt, params[, constraint]) → its deltas (index, tokens, logprobs, finish)."""

    async def one(rid, prompt, params, constraint=None):
        return [
            (d.index, d.token_ids, d.logprobs, d.finish_reason)
            async for d in engine.generate(prompt, params, rid, constraint)
        ]

    async def scenario():
        await engine.start()
        try:
            return await asyncio.gather(*(one(f"r{i}", *job) for i, job in enumerate(jobs)))
        finally:
            await engine.shutdown()

    return asyncio.run(scenario())


def _outputs(deltas: list[tuple]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for index, tokens, *_ in deltas:
        out.setdefault(index, []).extend(tokens)
    return out


def _references(prompts_and_runs) -> list[list[int]]:
    refs = []
    for prompt, deltas in prompts_and_runs:
        refs += [prompt + tokens for tokens in _outputs(deltas).values()]
    return refs


def _speculative_run(model, jobs, reference_runs, **overrides):
    source = HistoryDrafts(
        model.config.vocab_size,
        _references([(job[0], d) for job, d in zip(jobs, reference_runs, strict=True)]),
    )
    engine = _engine(model, source, speculative="dspark", **overrides)
    runs = _run(engine, jobs)
    assert_all_released(engine)
    return runs, engine.core.runner.speculative.metrics


def _prompt(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(100 + n + salt)
    return torch.randint(2, 1000, (n,), generator=g).tolist()


def regex_constraint(checkpoint, vocab_size: int, pattern: str):
    """(the checkpoint's tokenizer, a compiled regex constraint over `pattern`)."""
    from tokenizers import Tokenizer

    from engine.structured import GrammarCompiler, GrammarSpec

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab_size, 1)
    return tokenizer, compiler.constraint(GrammarSpec("regex", pattern))


def assert_in_language(tokenizer, pattern: str, tokens: list[int]) -> None:
    """`tokens` end with EOS (id 1) and spell a word of `pattern` before it."""
    words = "".join(tokenizer.id_to_token(t) for t in tokens[:-1])
    assert tokens[-1] == 1 and re.fullmatch(pattern, words), words


def test_stops_lengths_and_logprobs_inside_accepted_runs(tiny_model_exact_kv) -> None:
    """A stop id, max_tokens and logprobs that fall inside a run of accepted drafts: the same
    deltas as without speculation (never a token past the stop or the limit)."""
    model = tiny_model_exact_kv
    free = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    probe = _run(_engine(model), [(_prompt(9), free)])[0]
    stop_at = _outputs(probe)[0][37]
    jobs = [
        (_prompt(9), SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=(stop_at,))),
        (_prompt(12), SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)),
        (
            _prompt(7),
            SamplingParams(
                temperature=0.0, max_tokens=31, ignore_eos=True, logprobs=True, top_logprobs=2
            ),
        ),
    ]
    want = _run(_engine(model), jobs)
    got, metrics = _speculative_run(model, jobs, want)
    for mine, theirs in zip(got, want, strict=True):
        assert _outputs(mine) == _outputs(theirs)
        assert mine[-1][3] == theirs[-1][3]
    assert len(_outputs(got[1])[0]) == 23 and len(_outputs(got[2])[0]) == 31
    assert _outputs(got[0])[0][-1] == stop_at and got[0][-1][3] == "stop"
    mine_lps = [lp for d in got[2] for lp in d[2]]
    want_lps = [lp for d in want[2] for lp in d[2]]
    assert [e.token_id for e in mine_lps] == [e.token_id for e in want_lps]
    for a, b in zip(mine_lps, want_lps, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert max(len(d[1]) for run in got for d in run) > 1  # several tokens in one delta
    assert metrics.num_accepted > 0


def test_n_choices_in_coupled_mode_equal_non_speculative_bits(tiny_model_exact_kv) -> None:
    """Seeded sampling, n = 3, coupled acceptance: every choice's tokens equal the run without
    speculation, token for token (`dspark.md` §2.5), while drafts are accepted."""
    model = tiny_model_exact_kv
    params = SamplingParams(temperature=0.8, top_k=20, seed=5, n=3, max_tokens=40, ignore_eos=True)
    jobs = [(_prompt(10), params), (_prompt(13), params)]
    want = _run(_engine(model), jobs)
    got, metrics = _speculative_run(model, jobs, want, speculative_acceptance="coupled")
    assert [_outputs(r) for r in got] == [_outputs(r) for r in want]
    assert metrics.num_accepted > 0


# (engine overrides, whether they preempt): a KV pool too small for every request, and a token
# budget that chunks prefills into steps with verify rows
PREEMPTION_CASES = (
    ({"kv_cache_tokens": 5 * 128, "max_model_len": 5 * 128}, True),
    ({"max_num_batched_tokens": 40, "max_num_seqs": 4, "max_model_len": 5 * 128}, False),
)


def preemption_jobs(model) -> tuple[list, list, list[list[int]]]:
    """(greedy jobs, their runs without speculation, the reference continuations) of the
    `PREEMPTION_CASES` scenario."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    jobs = [(_prompt(n, salt=1), params) for n in (100, 90, 80, 70)]
    want = _run(_engine(model, max_model_len=5 * 128), jobs)
    return jobs, want, _references([(p, d) for (p, _), d in zip(jobs, want, strict=True)])


def assert_greedy_unchanged(engine: AsyncEngine, got, want, preempts: bool) -> None:
    """The run's tokens equal the run without speculation, drafts were accepted, it preempted
    exactly when its case should, and it released everything."""
    assert [_outputs(r) for r in got] == [_outputs(r) for r in want]
    assert (engine.core.scheduler.num_preemptions > 0) == preempts
    assert engine.core.runner.speculative.metrics.num_accepted > 0
    assert_all_released(engine)


def test_preemption_and_chunked_prefill_beside_verify_rows(tiny_model_exact_kv) -> None:
    """A KV pool too small for every request (preemption, recompute) and a token budget that
    chunks prefills into steps with verify rows: the greedy tokens are unchanged."""
    model = tiny_model_exact_kv
    jobs, want, references = preemption_jobs(model)
    for overrides, preempts in PREEMPTION_CASES:
        source = HistoryDrafts(model.config.vocab_size, references)
        engine = _engine(model, source, speculative="dspark", **overrides)
        schedules = record_schedules(engine.core.scheduler)
        assert_greedy_unchanged(engine, _run(engine, jobs), want, preempts)
        if not preempts:  # some step carried a prefill chunk beside a decode row with drafts
            assert any(
                any(c.num_draft_slots for c in out.chunks)
                and any(c.sampling is None for c in out.chunks)
                for out in schedules
            )


def record_schedules(scheduler) -> list:
    """Every `SchedulerOutput` the scheduler hands out from now on, in order."""
    outputs = []
    schedule = scheduler.schedule

    def recording():
        outputs.append(schedule())
        return outputs[-1]

    scheduler.schedule = recording
    return outputs


@pytest.mark.parametrize("acceptance", ["rejection", "block"])
def test_sampled_outputs_have_the_non_speculative_distribution(
    tiny_model_exact_kv, acceptance: str
) -> None:
    """Rejection sampling and block verification end to end: 2 × 480 seeded requests,
    temperature 1 over a top-4 slice; the first token, the second and the third have the same
    distribution with and without speculation (two-sample chi-square, Bonferroni α = 1e-3 over
    3 tests)."""
    model = tiny_model_exact_kv
    prompt = _prompt(6)
    count = 480

    def jobs(first_seed: int):
        return [
            (prompt, SamplingParams(temperature=1.0, top_k=4, seed=first_seed + i, max_tokens=3))
            for i in range(count)
        ]

    plain = _run(_engine(model, max_num_seqs=160), jobs(0))
    # Drafts: the greedy continuation (fixed tokens, so q is one-hot; accepted w.p. p(d)).
    greedy = _run(_engine(model), [(prompt, SamplingParams(temperature=0.0, max_tokens=3))])
    source = HistoryDrafts(model.config.vocab_size, _references([(prompt, greedy[0])]))
    engine = _engine(
        model, source, speculative="dspark", max_num_seqs=160, speculative_acceptance=acceptance
    )
    spec = _run(engine, jobs(10_000))
    metrics = engine.core.runner.speculative.metrics
    assert metrics.num_accepted > 0
    # The counters agree: the histogram of a + 1, accepted drafts, first-position acceptance.
    assert metrics.num_request_steps == sum(metrics.accept_length)
    assert metrics.num_accepted == sum(k * c for k, c in enumerate(metrics.accept_length[1:]))
    assert metrics.accepted_per_position[1] == sum(metrics.accept_length[2:])
    for k in range(3):
        a = [_outputs(r)[0][k] for r in plain]
        b = [_outputs(r)[0][k] for r in spec]
        assert _two_sample_pvalue(a, b) > 1e-3 / 3, k


def test_block_verification_of_sampled_drafts_keeps_the_distribution(tiny_model_exact_kv) -> None:
    """Block verification with sampled, non-one-hot drafts (`MixtureDrafts` around the
    continuations of the run without speculation) and chains of up to 3 verified drafts:
    2 × 320 seeded requests of 5 tokens; each of tokens 2..5 has the distribution without
    speculation (two-sample chi-square, Bonferroni α = 1e-3 over 4 tests)."""
    model = tiny_model_exact_kv
    prompt = _prompt(6)
    count = 320

    def jobs(first_seed: int):
        return [
            (prompt, SamplingParams(temperature=1.0, top_k=4, seed=first_seed + i, max_tokens=5))
            for i in range(count)
        ]

    plain = _run(_engine(model, max_num_seqs=160), jobs(0))
    source = MixtureDrafts(model.config.vocab_size, _references([(prompt, r) for r in plain]))
    engine = _engine(
        model, source, speculative="dspark", max_num_seqs=160, speculative_acceptance="block"
    )
    spec = _run(engine, jobs(10_000))
    metrics = engine.core.runner.speculative.metrics
    assert sum(metrics.accept_length[3:]) > 0  # some steps accepted 2 drafts or more
    assert metrics.num_accepted == sum(k * c for k, c in enumerate(metrics.accept_length[1:]))
    for k in range(1, 5):
        a = [_outputs(r)[0][k] for r in plain]
        b = [_outputs(r)[0][k] for r in spec]
        assert _two_sample_pvalue(a, b) > 1e-3 / 4, k


def _two_sample_pvalue(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square homogeneity test over the observed categories (cells with fewer
    than 5 expected pooled)."""
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    total = ca + cb
    small = total < 10
    if small.any():
        ca = torch.cat([ca[~small], ca[small].sum()[None]])
        cb = torch.cat([cb[~small], cb[small].sum()[None]])
        total = ca + cb
    keep = total > 0
    ca, cb, total = ca[keep], cb[keep], total[keep]
    na, nb = ca.sum(), cb.sum()
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    stat = float(((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum())
    dof = len(total) - 1
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_grammar_constrained_outputs_stay_valid(tiny_model_exact_kv, tiny_checkpoint) -> None:
    """Regex-constrained requests (greedy, sampled by rejection, and coupled): every verify row
    is masked, wrong drafts are rejected without advancing the matcher, outputs match the
    grammar, and the greedy and coupled outputs equal the runs without speculation."""
    model = tiny_model_exact_kv
    pattern = "(tok4|tok5|tok6)(tok7|Tok8|tok9|tok1[0-9]){6,12}"
    tokenizer, regex = regex_constraint(tiny_checkpoint, model.config.vocab_size, pattern)
    greedy = SamplingParams(temperature=0, max_tokens=30)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=30)
    jobs = [([0, 20 + i, 40], p, regex) for i, p in enumerate((greedy, sampled, greedy))]
    for acceptance in ("rejection", "block", "coupled"):
        want = _run(_engine(model), jobs)
        got, metrics = _speculative_run(model, jobs, want, speculative_acceptance=acceptance)
        assert metrics.num_accepted > 0
        for i, deltas in enumerate(got):
            tokens = _outputs(deltas)[0]
            assert deltas[-1][3] == "stop"
            assert_in_language(tokenizer, pattern, tokens)
            if i != 1 or acceptance == "coupled":
                assert tokens == _outputs(want[i])[0]


def test_the_dspark_drafter_samples_position_keyed_drafts(tiny_model_exact_kv) -> None:
    """The product drafter on sampled requests: in the coupled mode its drafts use the target
    sampler's noise, so seeded outputs equal decoding without speculation bit for bit; in the
    rejection and block modes its Markov-corrected logits are the q of the test (outputs well
    formed)."""
    model = tiny_model_exact_kv
    params = SamplingParams(temperature=0.9, seed=21, n=2, max_tokens=24, ignore_eos=True)
    jobs = [(_prompt(8), params), (_prompt(11), params)]
    want = _run(_engine(model), jobs)
    coupled = _engine(model, speculative="dspark", speculative_acceptance="coupled")
    assert [_outputs(r) for r in _run(coupled, jobs)] == [_outputs(r) for r in want]
    for acceptance in ("rejection", "block"):
        engine = _engine(model, speculative="dspark", speculative_acceptance=acceptance)
        got = _run(engine, jobs)
        assert all(len(tokens) == 24 for run in got for tokens in _outputs(run).values())
        assert engine.core.runner.speculative.metrics.num_verified > 0
        assert_all_released(engine)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_accepted_drafts_that_complete_a_kv_block_keep_the_request_alive(
    tiny_model_exact_kv, async_scheduling: bool
) -> None:
    """Accepted drafts that carry a request across a KV block boundary: the prefix cache
    indexes the block once its tokens are known (it used to index it by computed positions
    before the accepted tokens were appended: IndexError, every request of the step aborted),
    and the outputs are those of decoding without speculation."""
    model = tiny_model_exact_kv
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    jobs = [(_prompt(118 + i), params) for i in range(10)]
    settings = {"async_scheduling": async_scheduling}
    want = _run(_engine(model, **settings), jobs)
    got, metrics = _speculative_run(model, jobs, want, **settings)
    for mine, theirs in zip(got, want, strict=True):
        assert _outputs(mine) == _outputs(theirs)
        assert mine[-1][3] == "length"
    assert metrics.num_accepted > 0
