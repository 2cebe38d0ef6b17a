"""A warmed engine compiles nothing while it serves (issue 17: Triton JIT compiles and autotuning
under load were 32 % of the engine thread on the H200, ITL p99 2.4 s).

The engine is built as the server builds it (`AsyncEngine.from_config`, the `default` model on
CUDA, the server's limits), so its start captures the CUDA graphs and runs the warm-up
(`engine/models/deepseek_v41/warm_up.py`). Then Triton's post-compile hook
(`triton.knobs.runtime.jit_post_compile_hook`, called after every compile of a kernel variant,
an autotuner's candidates included) records each compile while requests run whose steps cover
context growth (the indexer's visible key count num_j), prefill chunks of several lengths,
mixed steps and several batch sizes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.test_engine_e2e import _collect

PROMPT_LENGTHS = (1, 17, 130, 600, 2000)
MAX_NUM_SEQS = EngineConfig().max_num_seqs  # the server's default limits


@contextmanager
def recorded_compiles() -> Iterator[list[str]]:
    """Each Triton compile inside the block, as the kernel's name and specialisation."""
    import triton

    compiles: list[str] = []

    def hook(**info: object) -> bool | None:
        if not info.get("already_compiled", False):
            compiles.append(str(info["repr"]))
        return None

    runtime = triton.knobs.runtime
    assert hasattr(runtime, "jit_post_compile_hook"), f"Triton {triton.__version__}: no hook"
    previous = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = hook
    try:
        yield compiles
    finally:
        runtime.jit_post_compile_hook = previous


def _jobs(vocab_size: int) -> list[list[tuple[list[int], SamplingParams]]]:
    """Rounds of concurrent requests: every prompt length alone, all of them together (mixed
    chunk + decode steps), and 16 at once; greedy, sampled and top-p rows, 50 tokens each."""
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, min(vocab_size, 100_000), (n,), generator=g).tolist()

    kinds = [
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=1, max_tokens=50, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=50, ignore_eos=True),
    ]
    rounds = [[(prompt(n), kinds[i % 3])] for i, n in enumerate(PROMPT_LENGTHS)]
    rounds.append([(prompt(n), kinds[i % 3]) for i, n in enumerate(PROMPT_LENGTHS)])
    sixteen = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] + i for i in range(16)]
    rounds.append([(prompt(n), kinds[i % 3]) for i, n in enumerate(sixteen)])
    return rounds


async def _serve(engine: AsyncEngine, rounds) -> list[list[int]]:
    """The rounds one after the other on one running engine; each request's tokens."""
    await engine.start()
    try:
        tokens = []
        for jobs in rounds:
            results = await asyncio.gather(
                *(
                    _collect(engine, p, params, f"r{len(tokens)}-{i}")
                    for i, (p, params) in enumerate(jobs)
                )
            )
            tokens += [result[0][0] for result in results]
        return tokens
    finally:
        await engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", ["off", "dspark"])
def test_a_warmed_engine_compiles_no_kernel_while_it_serves(speculative: str) -> None:
    config = EngineConfig(
        model="default",
        device="cuda",
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=max(EngineConfig().max_num_batched_tokens, MAX_NUM_SEQS),
        speculative=speculative,
        # NOTE: the segment-graph path the warm-up was measured with on the H200; the step
        # graphs (the default with speculation off) capture per shape on first use.
        cuda_graph_mode="segments",
    )
    engine = AsyncEngine.from_config(config)  # captures the graphs, warms the kernels up
    vocab_size = engine.core.runner.model.config.vocab_size
    with recorded_compiles() as compiles:
        tokens = asyncio.run(_serve(engine, _jobs(vocab_size)))
    assert [len(t) for t in tokens] == [50] * len(tokens)
    assert compiles == [], f"{len(compiles)} compiles while serving:\n" + "\n".join(compiles[:30])
