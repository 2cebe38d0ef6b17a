"""CUDA-graph replay of the blocks' pure parts (`engine.models.graphed`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import load_model, sequential_batch
from engine.models.graphed import DEFAULT_BUCKETS, GraphedSegment, bucket_for


def test_buckets_hold_each_token_count_in_the_smallest_one() -> None:
    assert [bucket_for(n, DEFAULT_BUCKETS) for n in (1, 3, 16, 17, 500, 512)] == [
        1, 4, 16, 24, 512, 512,
    ]  # fmt: skip
    assert bucket_for(513, DEFAULT_BUCKETS) is None
    with pytest.raises(ValueError, match="increasing"):
        GraphedSegment(lambda x: (x,), buckets=(4, 2))


def test_segments_run_eagerly_off_cuda() -> None:
    segment = GraphedSegment(lambda x: (x * 2,))
    (out,) = segment(torch.ones(3, 2))
    assert torch.equal(out, torch.full((3, 2), 2.0)) and segment.replays == 0


@pytest.mark.gpu
def test_graphed_decode_matches_eager_decode(tiny_checkpoint: Path) -> None:
    # Decode steps of changing batch sizes and positions, graphed and eager, from equal states.
    # Batches of 4 and 2 rows fill their buckets: the same kernels run, so the logits are
    # bitwise equal. The last step's 3 rows run padded to 4 (other matmul shapes: equal to
    # rounding).
    prompts = [[0] + list(range(10, 10 + n)) for n in (30, 17, 45, 8)]
    schedule = [[0, 1, 2, 3], [0, 2], [0, 1, 2, 3], [1, 3], [0, 1, 2]]

    def run(graphs: bool) -> tuple[list[torch.Tensor], object]:
        model = load_model(
            tiny_checkpoint, device="cuda", dtype=torch.bfloat16, quantized_experts=True
        )
        batch, state = model.fresh_batch(prompts)
        logits = []
        with torch.inference_mode():
            model.forward_step(batch, state)  # the prompts, eagerly in both runs
            if graphs:
                model.enable_cuda_graphs()
            positions = [len(p) for p in prompts]
            for step, seqs in enumerate(schedule):
                step_batch = sequential_batch(
                    [[7 + step] for _ in seqs],
                    [positions[s] for s in seqs],
                    seqs,
                    batch.block_tables[seqs],
                    device="cuda",
                )
                logits.append(model.forward_step(step_batch, state).logits.float())
                for s in seqs:
                    positions[s] += 1
        return logits, model

    eager, _ = run(False)
    graphed, model = run(True)
    assert model.graph_failures() == {}
    first, *others = model.layers
    assert all(block.graphs.attention_out.replays == len(schedule) for block in model.layers)
    assert all(block.graphs.attention_in.replays == len(schedule) for block in others)
    assert first.graphs.attention_in.replays == 0  # no previous `pre`: eager
    assert sorted(first.graphs.attention_out.graphs) == [2, 4]
    differences = [float((g - e).norm() / e.norm()) for g, e in zip(graphed, eager, strict=True)]
    assert differences[:-1] == [0.0] * (len(schedule) - 1), differences
    assert differences[-1] < 1e-2, differences
