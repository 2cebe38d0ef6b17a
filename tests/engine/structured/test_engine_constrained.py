"""Grammar-constrained generation through the async engine on the `tiny` model.

The tiny checkpoint's tokenizer is a word list (`tok4`, `tok5`, ..., `Tok323`), so grammars over
whole words give exact expectations: the allowed ids are known and greedy random logits must
still land inside them.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.async_engine import AsyncEngine, EngineConfig
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.structured import CompiledConstraint, GrammarCompiler, GrammarSpec
from tests.engine.engine_checks import assert_all_released

TINY_VOCAB = 1024
EOS_ID = 1


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny_compiler(tiny_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tiny_tokenizer, TINY_VOCAB, EOS_ID)


def _constraint(compiler: GrammarCompiler, kind: str, source: str) -> CompiledConstraint:
    return compiler.constraint(GrammarSpec(kind, source))


def _engine(model, **overrides) -> AsyncEngine:
    settings = {"max_num_seqs": 16, "kv_cache_tokens": 8192, **overrides}
    config = EngineConfig(model="tiny", **settings)
    return AsyncEngine.from_model(model, config)


async def _collect(engine, prompt, params, rid, constraint=None) -> tuple[list[int], FinishReason]:
    tokens: list[int] = []
    finish = None
    async for delta in engine.generate(prompt, params, rid, constraint):
        tokens.extend(delta.token_ids)
        finish = delta.finish_reason or finish
    return tokens, finish


async def _run_all(engine: AsyncEngine, jobs) -> list[tuple[list[int], FinishReason]]:
    await engine.start()
    try:
        return await asyncio.gather(
            *(_collect(engine, *job[:2], f"r{i}", *job[2:]) for i, job in enumerate(jobs))
        )
    finally:
        await engine.shutdown()


def _words(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.id_to_token(i) for i in ids]


@pytest.mark.parametrize("overlap", [True, False])
def test_constrained_and_free_requests_share_a_batch(
    tiny_model, tiny_tokenizer, tiny_compiler, overlap: bool
) -> None:
    regex = _constraint(tiny_compiler, "regex", "(tok4|tok5|tok6)(tok7|Tok8|tok9){2,5}")
    ebnf = _constraint(tiny_compiler, "ebnf", 'root ::= "tok10" ("tok11" "tok12")* "tok13"')
    greedy = SamplingParams(temperature=0, max_tokens=30)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=30)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[0, 20 + i, 30 + i, 40] for i in range(6)]
    jobs = [
        (prompts[0], greedy, regex),
        (prompts[1], sampled, regex),
        (prompts[2], greedy, ebnf),
        (prompts[3], sampled, ebnf),
        (prompts[4], free),
        (prompts[5], sampled, regex),
    ]
    engine = _engine(tiny_model, overlap_grammar_mask=overlap)
    results = asyncio.run(_run_all(engine, jobs))
    assert_all_released(engine)
    for (tokens, finish), job in zip(results, jobs, strict=True):
        if len(job) == 2:
            continue
        assert finish is FinishReason.STOP and tokens[-1] == EOS_ID
        text = "".join(_words(tiny_tokenizer, tokens[:-1]))
        pattern = job[2].spec.source
        if job[2].spec.kind == "ebnf":
            pattern = "tok10(tok11tok12)*tok13"
        assert re.fullmatch(pattern, text), text
    # The mask touches constrained rows only: the free request equals its run alone.
    alone = asyncio.run(_run_all(_engine(tiny_model), [(prompts[4], free)]))[0]
    assert results[4] == alone
    # Seeded constrained sampling is batch-invariant too.
    alone = asyncio.run(_run_all(_engine(tiny_model), [jobs[1]]))[0]
    assert results[1] == alone


def test_overlap_does_not_change_tokens(tiny_model, tiny_compiler) -> None:
    regex = _constraint(tiny_compiler, "regex", "((tok4|tok5|tok6) (tok7|tok8)?){3,9}")
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=40)
    jobs = [([0, 50 + i, 7], params, regex) for i in range(4)]
    on = asyncio.run(_run_all(_engine(tiny_model, overlap_grammar_mask=True), jobs))
    off = asyncio.run(_run_all(_engine(tiny_model, overlap_grammar_mask=False), jobs))
    assert on == off


@pytest.mark.slow  # ~8 s
def test_preemption_keeps_the_grammar_state(tiny_model_exact_kv, tiny_compiler) -> None:
    # Exactly 100 words then EOS: a matcher that restarted after preemption would end early or
    # reject the resumed tokens.
    exact = _constraint(tiny_compiler, "regex", "(tok4|tok5|tok6|tok7){100}")
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=110)
    prompts = [[0] + list(range(5, 5 + n)) for n in (100, 90, 80, 70)]
    jobs = [(p, params, exact) for p in prompts]
    roomy = _engine(tiny_model_exact_kv, max_model_len=5 * 128, kv_cache_tokens=8192)
    reference = asyncio.run(_run_all(roomy, jobs))
    tight = _engine(tiny_model_exact_kv, kv_cache_tokens=5 * 128, max_model_len=5 * 128)
    squeezed = asyncio.run(_run_all(tight, jobs))
    assert tight.core.scheduler.num_preemptions > 0
    assert squeezed == reference
    for tokens, finish in squeezed:
        assert len(tokens) == 101 and tokens[-1] == EOS_ID and finish is FinishReason.STOP
    assert_all_released(tight)


def test_max_tokens_cuts_a_grammar_short_and_aborts_free_matchers(
    tiny_model, tiny_compiler
) -> None:
    endless = _constraint(tiny_compiler, "regex", "(tok4|tok5)+tok9")
    engine = _engine(tiny_model)

    async def scenario() -> None:
        await engine.start()
        params = SamplingParams(temperature=0, max_tokens=5)
        tokens, finish = await _collect(engine, [0, 3, 4], params, "short", endless)
        assert finish is FinishReason.LENGTH and len(tokens) == 5 and EOS_ID not in tokens
        stream = engine.generate([0, 8], SamplingParams(max_tokens=500), "gone", endless)
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()  # client gone mid-decode
        await engine.shutdown()

    asyncio.run(scenario())
    assert_all_released(engine)


def test_constraint_must_fit_the_model(tiny_model, tiny_compiler) -> None:
    engine = _engine(tiny_model)
    regex = _constraint(tiny_compiler, "regex", "tok4")

    async def scenario() -> None:
        with pytest.raises(ValueError, match="ignore_eos"):
            await _collect(engine, [0, 5], SamplingParams(ignore_eos=True), "x", regex)

    asyncio.run(scenario())
