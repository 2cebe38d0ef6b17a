"""`--ep 1 --engine-process`: the one engine rank in a process of its own (`MultiProcessEngine`
over `RankEngine.build_alone`, no groups, no lockstep) gives the in-process engine's greedy
tokens, aborts a stream its consumer leaves, and leaves no process behind."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import EngineConfig
from engine.client import InProcessEngine
from engine.distributed.config import ParallelConfig
from engine.distributed.multiprocess import MultiProcessEngine
from engine.sampling_params import SamplingParams

ENGINE = EngineConfig(
    model="tiny",
    max_num_seqs=4,
    max_num_batched_tokens=64,  # prompts are chunked beside decode rows
    kv_cache_tokens=4096,
    max_model_len=1024,
    kv_storage="exact",
    speculative="off",
)
PROMPTS = [[5 + i, 17, 3 * i + 2, *range(40, 40 + 23 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def _one(engine, rid: str, prompt: list[int], stop_after: int | None = None) -> list[int]:
    tokens: list[int] = []
    async for delta in engine.generate(prompt, GREEDY, rid):
        assert delta.error is None, delta.error
        tokens.extend(delta.token_ids)
        if stop_after is not None and len(tokens) >= stop_after:
            break  # leaving the stream aborts the request
    return tokens


def _scenario(engine) -> tuple[list[list[int]], list[int]]:
    """Every prompt to the end, and then one stream left after two tokens."""

    async def run():
        await engine.start()
        try:
            full = await asyncio.gather(*(_one(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
            left = await _one(engine, "left", PROMPTS[1], stop_after=2)
            for _ in range(200):  # the abort reaches the engine within a step or two
                if engine.snapshot().num_running == 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.snapshot().num_running == 0
            return full, left
        finally:
            await engine.shutdown()

    return asyncio.run(run())


@pytest.mark.slow
def test_an_engine_process_gives_the_in_process_tokens_and_leaves_nothing_behind() -> None:
    in_process = InProcessEngine.from_config(ENGINE)
    expected, _ = _scenario(in_process)
    assert in_process.snapshot().ranks[0].process_cpu_s is None  # the API process's own CPU
    engine = MultiProcessEngine(ENGINE, ParallelConfig(ep_size=1, engine_process=True))
    assert engine.info.num_ranks == 1
    got, left = _scenario(engine)
    assert got == expected
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got)
    assert left == expected[1][: len(left)] and len(left) >= 2
    assert engine.snapshot().ranks[0].is_idle  # no block or slot left held in the process
    assert engine.snapshot().ranks[0].process_cpu_s > 0  # the rank's process reports its CPU
    assert not any(proc.is_alive() for proc in engine._procs)


def test_engine_process_is_for_one_rank() -> None:
    with pytest.raises(ValueError, match="one rank"):
        ParallelConfig(ep_size=2, engine_process=True)
