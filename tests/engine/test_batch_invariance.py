"""Batch-invariant mode (`EngineConfig.batch_invariant`, `--batch-invariant`) through EngineCore.

One probe request runs alone, then beside 8 and beside 64 other requests of other lengths: half
arrive with it (its prefill shares a step with theirs), half two steps later (its decode steps
share steps with their prefills, so its rows sit in batches padded to longer chunks), and they
finish at different steps (the batch shrinks under it). Its per-step logprobs (the chosen token's
and the top 5, i.e. log_softmax of its logits) must be bit-identical each time; greedy, and
sampled (seeded top-p beside requests whose top-k values change the sampler's batch-wide
candidate counts).

In the default mode the same comparison differs on the CPU (MKL computes one row as a GEMV,
a few rows and many rows with other kernels; torch's pointwise sigmoid/SiLU/softplus round
the tail of a tensor differently; the attention pads to the longest chunk): the last test shows
that the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.core import EngineCore
from engine.models import load_model
from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampling_params import SamplingParams

EOS_ID = 1
PROBE_TOKENS = 10


def _request(rid: str, prompt: list[int], max_tokens: int, **params) -> Request:
    sampling = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=5,
        **{"temperature": 0.0, **params},
    )
    return Request(rid, prompt, sampling, seed=7, arrival_time=0.0, eos_token_id=EOS_ID)


def _prompts(count: int, vocab: int) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(3)
    high = min(vocab, 1000)
    probe = torch.randint(3, high, (37,), generator=g).tolist()
    others = []
    for _ in range(count):
        length = int(torch.randint(5, 90, (1,), generator=g))
        others.append(torch.randint(3, high, (length,), generator=g).tolist())
    return probe, others


def _core(model, config: EngineConfig) -> EngineCore:
    return AsyncEngine.from_model(model, config).core


def _probe_logprobs(
    core: EngineCore, probe: list[int], others: list[list[int]], sampled: bool = False
) -> list:
    """The probe's (token, logprob, top-5) per step, with `others` around it (see above).

    sampled: the probe samples (temperature 0.8, top-p 0.9, seeded) and the others sample
    with top-k values that change the sampler's batch-wide choices (candidate counts)."""
    probe_params = {"temperature": 0.8, "top_p": 0.9} if sampled else {}
    core.add_request(_request("probe", probe, PROBE_TOKENS, **probe_params))

    def params(i: int) -> dict:
        return {"temperature": 1.0, "top_k": 3 + 131 * i % 1000, "top_p": 0.95} if sampled else {}

    first, late = others[: len(others) // 2], others[len(others) // 2 :]
    for i, prompt in enumerate(first):
        core.add_request(_request(f"a{i}", prompt, 3 + i % 9, **params(i)))
    entries: list[TokenLogprob] = []
    step = 0
    while core.has_work():
        if step == 2:
            for i, prompt in enumerate(late):
                core.add_request(_request(f"b{i}", prompt, 2 + i % 7, **params(i + 1)))
        for delta in core.step():
            if delta.request_id == "probe" and delta.logprobs:
                entries.extend(delta.logprobs)
        step += 1
    assert len(entries) == PROBE_TOKENS
    return [(e.token_id, e.logprob, e.top) for e in entries]


def _config(**overrides) -> EngineConfig:
    settings = {
        "model": "tiny",
        "max_num_seqs": 72,
        "max_num_batched_tokens": 8192,
        "kv_cache_tokens": 32768,
        "enable_prefix_caching": False,
        "max_model_len": 4096,
    }
    return EngineConfig(**{**settings, **overrides})


def _differing_steps(
    model, config: EngineConfig, num_others: int, sampled: bool = False
) -> list[int]:
    probe, others = _prompts(64, model.config.vocab_size)
    alone = _probe_logprobs(_core(model, config), probe, [], sampled)
    beside = _probe_logprobs(_core(model, config), probe, others[:num_others], sampled)
    return [i for i, (a, b) in enumerate(zip(alone, beside, strict=True)) if a != b]


@pytest.fixture(scope="module", params=["quantized", "exact"])
def invariant_tiny(request, tiny_checkpoint):
    config = _config(kv_storage=request.param, batch_invariant=True)
    return load_model(tiny_checkpoint, numerics=config.numerics), config


# Beside 64 others: 6-13 s a KV storage, so in the slow tier
@pytest.mark.parametrize("num_others", [8, pytest.param(64, marks=pytest.mark.slow)])
def test_logprobs_are_bitwise_the_same_alone_and_inside_a_batch(invariant_tiny, num_others) -> None:
    model, config = invariant_tiny
    assert _differing_steps(model, config, num_others) == []


def test_sampled_tokens_and_processed_logprobs_are_the_same_beside_sampling_requests(
    invariant_tiny,
) -> None:
    """The sampler's part: a seeded top-p request beside requests whose top-k changes the
    step's candidate counts draws the same tokens with the same processed logprobs."""
    model, config = invariant_tiny
    assert _differing_steps(model, config, 8, sampled=True) == []


@pytest.mark.slow  # the `default` model on the shared CPU
def test_the_default_model_is_bitwise_the_same_beside_8_requests(default_checkpoint) -> None:
    """The `default` structure (real vocabulary, 128-token window, wider heads), quantized KV."""
    config = _config(model="default", batch_invariant=True)
    model = load_model(default_checkpoint, numerics=config.numerics)
    assert _differing_steps(model, config, 8) == []


def test_greedy_tokens_equal_the_default_modes(invariant_tiny, tiny_checkpoint) -> None:
    """The mode changes rounding, not the model: on `tiny` its greedy tokens are the default
    mode's (same KV storage)."""
    model, config = invariant_tiny
    default_config = _config(kv_storage=config.kv_storage)
    default = load_model(tiny_checkpoint, numerics=default_config.numerics)
    probe, others = _prompts(8, model.config.vocab_size)
    ours = _probe_logprobs(_core(model, config), probe, others)
    theirs = _probe_logprobs(_core(default, default_config), probe, others)
    assert [t for t, _, _ in ours] == [t for t, _, _ in theirs]


def test_the_default_mode_differs_on_the_same_comparison(tiny_checkpoint) -> None:
    """The comparison above can fail: without the mode, the probe's logprobs move with its
    batch on the CPU."""
    config = _config(kv_storage="exact")
    model = load_model(tiny_checkpoint, numerics=config.numerics)
    assert _differing_steps(model, config, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_storage", ["quantized", "exact"])
@pytest.mark.parametrize("num_others", [8, 64])
def test_logprobs_are_bitwise_the_same_alone_and_inside_a_batch_on_cuda(
    tiny_checkpoint, kv_storage: str, num_others: int
) -> None:
    """CUDA, bf16 (the serving dtype: MXFP4 experts through the grouped kernel's fixed tiles,
    the attention kernel on quantized KV) with CUDA graphs: the same bitwise comparison."""
    config = _config(
        kv_storage=kv_storage,
        batch_invariant=True,
        device="cuda",
        dtype="bfloat16",
        speculative="off",
        async_scheduling=False,
    )
    model = load_model(
        tiny_checkpoint,
        device="cuda",
        dtype=torch.bfloat16,
        quantized_experts=config.quantized_experts,
        numerics=config.numerics,
    )
    model.enable_cuda_graphs()
    assert _differing_steps(model, config, num_others) == []
    assert _differing_steps(model, config, num_others, sampled=True) == []
