"""The engine as `from_config` builds it on CUDA: MXFP4 experts, CUDA graphs captured at start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.overlap import OverlappedCore
from engine.sampling_params import SamplingParams
from engine.speculative.overlap import OverlappedSpeculativeCore
from tests.engine.engine_checks import assert_all_released
from tests.engine.test_engine_e2e import _run_all


@pytest.mark.gpu
def test_graphed_engine_generates_what_the_eager_engine_does(tiny_checkpoint: Path) -> None:
    # A 16-token prompt and single-sequence decode fill their buckets (16, then 1): the graphs
    # run the eager kernels on the same shapes, so greedy tokens agree exactly. Without
    # speculation (one token per step; with it, the start may profile the step-time table
    # through the same graphs, or read it from the disk cache another test wrote).
    prompt = [0] + list(range(20, 35))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results, replays = {}, 0
    for graphs in (False, True):
        config = EngineConfig(
            model=str(tiny_checkpoint),
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=4,
            kv_cache_tokens=4096,
            max_model_len=1024,
            cuda_graphs=graphs,
            cuda_graph_mode="segments",  # the per-block graphs this test counts
            speculative="off",
        )
        engine = AsyncEngine.from_config(config)
        second = engine.core.runner.model.layers[1].graphs
        before = second.attention_in.replays if graphs else 0
        results[graphs] = asyncio.run(_run_all(engine, [(prompt, greedy)]))[0]
        replays = second.attention_in.replays - before if graphs else 0
        assert_all_released(engine)
    model = engine.core.runner.model
    assert model.graph_failures() == {}
    second = model.layers[1].graphs
    assert sorted(second.attention_in.graphs)[:3] == [1, 2, 4]  # captured at start
    assert replays == 12  # the prompt, then 11 decode steps
    assert results[True] == results[False] and len(results[True][0][0]) == 12


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", ["off", "dspark"])
def test_async_scheduling_on_cuda_generates_what_the_synchronous_engine_does(
    tiny_checkpoint: Path, speculative: str
) -> None:
    # Greedy and seeded rows of different lengths, an EOS-biased and a penalised row: async
    # scheduling (the CUDA default, with speculation too) must give the synchronous engine's
    # tokens exactly (`--no-async-scheduling`, async_scheduling=False, compares).
    eos = 1
    jobs = [
        ([0, *range(20, 35)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        ([0, 9, 8], SamplingParams(temperature=1.0, seed=3, max_tokens=9, n=2)),
        ([0, 4, 4], SamplingParams(temperature=1.0, seed=5, logit_bias={eos: 4.0}, max_tokens=30)),
        ([0, 3, 2], SamplingParams(temperature=0.7, seed=2, frequency_penalty=1.5, max_tokens=8)),
    ]
    results = {}
    for overlapped in (False, None):
        config = EngineConfig(
            model=str(tiny_checkpoint),
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=8,
            kv_cache_tokens=4096,
            max_model_len=1024,
            async_scheduling=overlapped,
            speculative=speculative,
        )
        engine = AsyncEngine.from_config(config)
        if overlapped is None:
            core = OverlappedSpeculativeCore if speculative == "dspark" else OverlappedCore
            assert type(engine.core) is core
        results[overlapped] = asyncio.run(_run_all(engine, jobs))
        assert_all_released(engine)
    assert results[None] == results[False]


@pytest.mark.gpu
def test_cuda_defaults_to_bfloat16_with_graphs_and_float32_runs_eagerly_with_a_warning(
    tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`dtype` auto is bfloat16 on CUDA: MXFP4 experts and every block graphed. float32
    dequantises the experts (their per-expert path reads counts on the host): no capture is
    tried, and the start says so."""
    settings = {"model": str(tiny_checkpoint), "device": "cuda", "max_num_seqs": 4}
    settings |= {"kv_cache_tokens": 4096, "max_model_len": 1024, "speculative": "off"}
    default = AsyncEngine.from_config(EngineConfig(**settings)).core.runner.model
    assert default.dtype == torch.bfloat16 and default.quantized_experts
    assert all(block.graphs is not None for block in default.layers)
    assert default.graph_failures() == {}
    with caplog.at_level("WARNING"):
        fp32 = AsyncEngine.from_config(EngineConfig(**settings, dtype="float32")).core.runner.model
    assert all(block.graphs is None for block in fp32.layers)
    assert "CUDA graphs off" in caplog.text
