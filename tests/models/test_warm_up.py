"""The start-up warm-up (`engine/models/deepseek_v41/warm_up.py`): every serving launch shape
once, on scratch state that leaves the model's answers unchanged."""

from __future__ import annotations

import torch

from engine.models.deepseek_v41.warm_up import serving_warm_up_steps, warm_up
from kernels import sparse_mqa


def test_warm_up_leaves_the_models_answers_unchanged(tiny_model) -> None:
    prompts = [[0, *range(20, 60)], [0, 5, 9]]
    before = tiny_model.logits(prompts)
    steps = serving_warm_up_steps(max_prefill_tokens=512, max_num_seqs=4, num_speculative_tokens=5)
    warm_up(tiny_model, steps)
    assert torch.equal(tiny_model.logits(prompts), before)


def test_the_serving_steps_reach_every_sparse_attention_tile_row() -> None:
    # each row of `sparse_mqa.TILES` (launch shapes chosen by the launch's token count) must be
    # compiled at start: some warm-up step's token count falls in every row's range
    steps = serving_warm_up_steps(
        max_prefill_tokens=32768, max_num_seqs=256, num_speculative_tokens=5
    )
    counts = [step.num_seqs * step.tokens_per_seq for step in steps]
    low = 0
    for bound, _ in sparse_mqa.TILES:
        assert any(low < count <= bound for count in counts), (low, bound, counts)
        low = bound
    assert max(counts) == 4096  # a long chunk, capped: longer chunks take the same tiles
    without = serving_warm_up_steps(32768, 256, num_speculative_tokens=0)
    assert all(step.tokens_per_seq in (1, 301, 4096) for step in without)
