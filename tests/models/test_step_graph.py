"""Whole-step CUDA graphs (`step_graph.py`) against eager decode steps.

The CPU tests check the runner's contract off the GPU; the `gpu` tests decode greedily with
and without step graphs from equal states, across batch-size changes (padding rows), a 128-token
block boundary and ratio-2 groups, and through the engine with `cuda_graph_mode="step"`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine.models import Numerics, load_model
from engine.models.deepseek_v41.decode_batch import can_pad
from engine.models.deepseek_v41.state import sequential_batch
from engine.models.deepseek_v41.step_graph import StepGraphs, blocks_bucket


def test_step_shapes_round_tables_up_to_a_power_of_two_or_one_and_a_half_times_one() -> None:
    widths = (1, 2, 3, 4, 5, 7, 9, 13, 64, 65, 97)
    assert [blocks_bucket(w) for w in widths] == [1, 2, 3, 4, 6, 8, 12, 16, 64, 96, 128]


def test_only_plain_decode_steps_pad() -> None:
    table = torch.tensor([[0, 1], [2, 3]])
    decode = sequential_batch([[5], [6]], [130, 7], [0, 1], table)
    chunk = sequential_batch([[5, 6], [7]], [3, 9], [0, 1], table)
    one_logit = sequential_batch(
        [[5], [6]], [3, 9], [0, 1], table, logits_indices=torch.tensor([1])
    )
    assert can_pad(decode)
    assert not can_pad(chunk) and not can_pad(one_logit)


def test_step_graphs_need_cuda(tiny_model) -> None:
    state = tiny_model.allocate_state(2, 2, reserve_scratch=True)
    with pytest.raises(ValueError, match="CUDA"):
        StepGraphs(tiny_model, state)


def _greedy_decode(
    model,
    prompts: list[list[int]],
    schedule: list[list[int]],
    step_graphs: bool,
    forced: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor], StepGraphs | None]:
    """Prefill `prompts` eagerly, then decode the sequences of each schedule entry one token
    each (greedy, or the tokens of `forced`, another run's result): their tokens per sequence,
    the logits per step and the step graphs."""
    blocks = [-(-(len(p) + len(schedule)) // 128) for p in prompts]
    table = torch.full((len(prompts), max(blocks)), -1, dtype=torch.long)
    first = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(first, first + n)
        first += n
    state = model.allocate_state(len(prompts), first, reserve_scratch=True)
    graphs = StepGraphs(model, state) if step_graphs else None
    with torch.inference_mode():
        prefill = sequential_batch(
            prompts, [0] * len(prompts), list(range(len(prompts))), table, device="cuda"
        )
        logits = model.forward_step(prefill, state).logits
        ends = torch.tensor([prefill.starts[i + 1] - 1 for i in range(len(prompts))])
        last = logits[ends.cuda()].argmax(-1).tolist()
        tokens = [[t] for t in last]
        positions = [len(p) for p in prompts]
        step_logits = []
        for seqs in schedule:
            batch = sequential_batch(
                [[tokens[s][-1]] for s in seqs],
                [positions[s] for s in seqs],
                seqs,
                table[seqs][:, : max(1, -(-(max(positions[s] for s in seqs) + 1) // 128))],
                device="cuda",
            )
            out = graphs.run(batch) if graphs is not None else None
            if out is None:
                out = model.forward_step(batch, state).logits
            step_logits.append(out.float())
            for s, t in zip(seqs, out.argmax(-1).tolist(), strict=True):
                tokens[s].append(t if forced is None else forced[s][len(tokens[s])])
                positions[s] += 1
    return tokens, step_logits, graphs


# Batch sizes 3, 4, 2, 3, ... (padding rows in buckets of 4), prompts ending before a block
# boundary (decode crosses position 128) and at both parities.
_PROMPT_LENS = (125, 60, 7, 126)
_SCHEDULE = [[0, 1, 2], [0, 1, 2, 3], [0, 3], [1, 2, 3], [0, 1, 2, 3], [0, 2], [0, 1, 2, 3]] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_quantize", [True, False])
def test_step_graphs_decode_the_eager_greedy_tokens(tiny_checkpoint: Path, kv_quantize: bool):
    model = load_model(
        tiny_checkpoint,
        device="cuda",
        dtype=torch.bfloat16,
        quantized_experts=True,
        numerics=Numerics(kv_quantize=kv_quantize),
    )
    # The graphed run is fed the eager run's tokens: padded rows change matmul shapes (equal to
    # rounding), so its greedy pick may differ only where the eager one is a near-tie.
    prompts = [[0, *range(10, 9 + n)] for n in _PROMPT_LENS]
    eager, eager_logits, _ = _greedy_decode(model, prompts, _SCHEDULE, step_graphs=False)
    _, graphed_logits, graphs = _greedy_decode(
        model, prompts, _SCHEDULE, step_graphs=True, forced=eager
    )
    assert graphs.graph_failures() == {}
    assert graphs.replays == len(_SCHEDULE)
    assert sorted(graphs.graphs) == [(2, 1), (2, 2), (4, 1), (4, 2)]
    for graphed_step, eager_step in zip(graphed_logits, eager_logits, strict=True):
        assert float((graphed_step - eager_step).norm() / eager_step.norm()) < 2e-2
        top2 = eager_step.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05
        same = graphed_step.argmax(-1) == eager_step.argmax(-1)
        assert bool(same[clear].all())


@pytest.mark.gpu
def test_a_failed_capture_falls_back_to_eager_steps(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A forward that raises while the stream captures (as an operation capture refuses does):
    # the failure is reported once, and the steps of that shape run eagerly, same tokens.
    model = load_model(tiny_checkpoint, device="cuda", dtype=torch.bfloat16, quantized_experts=True)
    prompts = [[0, *range(10, 30)], [0, 5, 6]]
    schedule = [[0, 1]] * 3
    eager, _, _ = _greedy_decode(model, prompts, schedule, step_graphs=False)
    forward_step = model.forward_step

    def refused_in_capture(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing (test)")
        return forward_step(*args, **kwargs)

    monkeypatch.setattr(model, "forward_step", refused_in_capture)
    graphed, _, graphs = _greedy_decode(model, prompts, schedule, step_graphs=True)
    assert list(graphs.graph_failures()) == ["step[2x1]"]
    assert "(test)" in graphs.graph_failures()["step[2x1]"]
    assert graphs.replays == 0
    assert graphed == eager


def _cuda_engine(checkpoint: Path, cuda_graph_mode: str, **overrides):
    """A small bf16 CUDA engine over `checkpoint`, speculation off."""
    from engine.async_engine import AsyncEngine, EngineConfig

    config = EngineConfig(
        model=str(checkpoint),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=4,
        kv_cache_tokens=8192,
        max_model_len=1024,
        speculative="off",
        cuda_graph_mode=cuda_graph_mode,
        **overrides,
    )
    return AsyncEngine.from_config(config)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "default_checkpoint"])
def test_step_graphed_engine_generates_what_the_segment_graphed_engine_does(
    checkpoint: str, request: pytest.FixtureRequest
) -> None:
    from engine.sampling_params import SamplingParams
    from tests.engine.engine_checks import assert_all_released
    from tests.engine.test_engine_e2e import _run_all

    path = request.getfixturevalue(checkpoint)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    jobs = [([0, *range(20, 140)], greedy), ([0, 9, 8], greedy), ([0, *range(40, 75)], greedy)]
    results = {}
    for mode in ("segments", "step"):
        engine = _cuda_engine(path, mode)
        results[mode] = asyncio.run(_run_all(engine, jobs))
        assert_all_released(engine)
        runner = engine.core.runner
        if mode == "step":
            assert runner.step_graphs is not None
            assert runner.model.graph_failures() == {}
            assert runner.step_graphs.replays > 0
        else:
            assert runner.step_graphs is None
    assert results["step"] == results["segments"]


async def _run_with_logprobs(engine, jobs) -> list[list]:
    """Each job's `TokenLogprob`s (sampled token, its logprob and the top two)."""

    async def one(prompt, params, rid):
        return [lp async for d in engine.generate(prompt, params, rid) for lp in d.logprobs]

    await engine.start()
    try:
        return await asyncio.gather(*(one(p, s, f"r{i}") for i, (p, s) in enumerate(jobs)))
    finally:
        await engine.shutdown()


def _assert_same_up_to_near_ties(ours: list, theirs: list, tie: float = 0.3) -> None:
    """Same greedy tokens with logprobs within `tie`, up to a first difference (if any) where
    both runs' two best tokens were within `tie` of each other (a rounding-level near tie; the
    continuations differ after it)."""
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        if mine.token_id != other.token_id:
            for lp in (mine, other):
                assert lp.top[0][1] - lp.top[1][1] < tie, (mine, other)
            return
        assert abs(mine.logprob - other.logprob) < tie, (mine, other)


@pytest.mark.gpu
def test_mixed_steps_replay_their_decode_rows_and_generate_the_segment_tokens(
    default_checkpoint: Path,
) -> None:
    # A long prompt chunked 32 tokens at a time while two short ones decode: most steps mix
    # decode rows with a prefill chunk. With step graphs those rows replay their graph (one
    # replay per step that has any) instead of riding in the chunk's padded forward, whose
    # window comes from decoded rows rather than the ring (equal up to the last bit): the
    # tokens are the segment-graphed engine's up to rounding-level near ties.
    from engine.sampling_params import SamplingParams
    from tests.engine.engine_checks import assert_all_released

    greedy = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    jobs = [([0, 9, 8], greedy), ([0, *range(40, 75)], greedy), ([0, *range(20, 260)], greedy)]
    results, steps = {}, {}
    for mode in ("segments", "step"):
        engine = _cuda_engine(default_checkpoint, mode, max_num_batched_tokens=32)
        scheduler = engine.core.scheduler
        schedule, outputs = scheduler.schedule, []
        scheduler.schedule = lambda s=schedule, o=outputs: o.append(s()) or o[-1]
        results[mode] = asyncio.run(_run_with_logprobs(engine, jobs))
        assert_all_released(engine)
        steps[mode] = [sorted({len(c.token_ids) > 1 for c in o.chunks}) for o in outputs]
        if mode == "step":
            with_decode_rows = sum(False in kinds for kinds in steps[mode])
            assert engine.core.runner.step_graphs.replays == with_decode_rows
    assert steps["step"].count([False, True]) >= 3  # mixed steps ran
    for ours, theirs in zip(results["step"], results["segments"], strict=True):
        _assert_same_up_to_near_ties(ours, theirs)
