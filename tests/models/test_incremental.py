"""Exact mode vs chunked vs token-by-token forwards of the `tiny` model (`model.md` §3.10).

Each check batches several sequences with different split points into one step, so chunk
boundaries at every offset cost two forwards. With the KV round trip off everything agrees to fp32
rounding; with it on a stored row's rounding step may flip, so argmax and ±5e-2 are required.
"""

from __future__ import annotations

import pytest
import torch

from engine.models import sequential_batch

PROMPT_LEN = 41  # odd: the last ratio-2 pair is pending at the end


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 1000, (length - 1,), generator=g).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _split_runs(model, prompt: list[int], splits: list[int]) -> torch.Tensor:
    """Run copy i of `prompt` as two chunks split at `splits[i]`; logits [n, L, V]."""
    n = len(splits)
    batch, state = model.fresh_batch([prompt] * n)
    tables = batch.block_tables
    first = sequential_batch([prompt[:k] for k in splits], [0] * n, list(range(n)), tables)
    second = sequential_batch([prompt[k:] for k in splits], splits, list(range(n)), tables)
    with torch.no_grad():
        a = model.forward_step(first, state).logits
        b = model.forward_step(second, state).logits
    out = torch.zeros(n, len(prompt), a.shape[-1])
    for i, k in enumerate(splits):
        out[i, :k] = a[first.starts[i] : first.starts[i + 1]]
        out[i, k:] = b[second.starts[i] : second.starts[i + 1]]
    return out


def _token_by_token(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    batch, state = model.fresh_batch(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.no_grad():
        for pos in range(max(map(len, prompts))):
            live = [i for i, p in enumerate(prompts) if pos < len(p)]
            step = sequential_batch(
                [[prompts[i][pos]] for i in live], [pos] * len(live), live, batch.block_tables[live]
            )
            logits = model.forward_step(step, state).logits
            for j, i in enumerate(live):
                rows[i].append(logits[j])
    return [torch.stack(r) for r in rows]


@pytest.mark.parametrize("fixture", ["tiny_model_exact_kv", "tiny_model"])
def test_chunk_boundaries_at_every_offset(fixture: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(fixture)
    prompt = _prompt(1, PROMPT_LEN)
    full = model.logits([prompt])[0]
    split = _split_runs(model, prompt, list(range(1, PROMPT_LEN)))
    for i in range(split.shape[0]):
        if fixture == "tiny_model_exact_kv":
            assert _rel(split[i], full) < 1e-5, f"split at {i + 1}"
        else:
            assert (split[i].argmax(-1) == full.argmax(-1)).all(), f"split at {i + 1}"
            assert (split[i] - full).abs().max() <= 5e-2, f"split at {i + 1}"


@pytest.mark.parametrize("fixture", ["tiny_model_exact_kv", "tiny_model"])
def test_token_by_token_matches_one_shot(fixture: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(fixture)
    prompts = [_prompt(2, 40), _prompt(3, 33), _prompt(4, 7)]  # even, odd and short lengths
    full = model.logits(prompts)
    for i, steps in enumerate(_token_by_token(model, prompts)):
        ref = full[i, : len(prompts[i])]
        if fixture == "tiny_model_exact_kv":
            assert _rel(steps, ref) < 1e-5
        else:
            assert (steps.argmax(-1) == ref.argmax(-1)).all()
            assert (steps - ref).abs().max() <= 5e-2


def test_batch_composition_does_not_change_logits(tiny_model) -> None:
    prompts = [_prompt(5, 50), _prompt(6, 17), _prompt(7, 1)]
    together = tiny_model.logits(prompts)
    for i, p in enumerate(prompts):
        alone = tiny_model.logits([p])[0]
        assert torch.allclose(together[i, : len(p)], alone, atol=1e-5, rtol=0)


def test_selection_uses_candidate_blocks_beyond_threshold(tiny_model_exact_kv) -> None:
    """Past 16 visible positions the candidate consumer's picks lie inside published blocks."""
    model = tiny_model_exact_kv
    cfg = model.config
    prompt = _prompt(8, 60)
    record: dict = {}
    model.logits([prompt], record=record)
    consumer = next(i for i in cfg.index_source_layer_ids if cfg.is_candidate_consumer(i))
    source = cfg.candidate_source_layer_id
    sel_consumer = record[f"layers.{consumer}.selection"]
    sel_source = record[f"layers.{source}.selection"]
    assert sel_consumer.shape == (60, cfg.index_topk)
    # Early rows see everything (≤ k visible), so both indexers select all visible positions.
    assert sorted(sel_source[3][sel_source[3] >= 0].tolist()) == [0, 1, 2, 3]
    # Late rows: consumer picks come from at most `candidate_topk_blocks` blocks, one of which
    # holds the newest position.
    late = sel_consumer[59]
    blocks = set((late[late >= 0] // cfg.candidate_block_size).tolist())
    assert len(blocks) <= cfg.candidate_topk_blocks
    assert 59 // cfg.candidate_block_size in blocks or len(blocks) == cfg.candidate_topk_blocks
    # The two indexers disagree somewhere: the restriction is doing something.
    assert not torch.equal(sel_consumer[16:], sel_source[16:])


def test_state_is_position_addressed_for_rewrites(tiny_model) -> None:
    """Recomputing positions already in the state (rejected drafts) reproduces the same logits."""
    model = tiny_model
    prompt = _prompt(9, 30)
    batch, state = model.fresh_batch([prompt])
    tables = batch.block_tables
    with torch.no_grad():
        model.forward_step(sequential_batch([prompt[:20]], [0], [0], tables), state)
        wrong = [5, 6, 7, 8, 9]  # "drafts" at positions 20..24, later rejected
        model.forward_step(sequential_batch([wrong], [20], [0], tables), state)
        redo = model.forward_step(sequential_batch([prompt[20:]], [20], [0], tables), state)
    full = model.logits([prompt])[0]
    assert (redo.logits.argmax(-1) == full[20:].argmax(-1)).all()
    assert (redo.logits - full[20:]).abs().max() <= 5e-2
