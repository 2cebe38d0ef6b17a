"""DSpark drafter modules (`model.md` §6.1): load, inject target context, draft a block."""

from __future__ import annotations

import torch

from engine.models import sequential_batch


def _prefill(model, prompt: list[int]):
    batch, state = model.fresh_batch([prompt + [0] * 8])
    step = sequential_batch([prompt], [0], [0], batch.block_tables)
    with torch.no_grad():
        out = model.forward_step(step, state)
        model.inject_draft_context(step, out.dspark_features, state)
    return out, step, state


def test_dspark_weights_load_under_released_names(tiny_model) -> None:
    names = dict(tiny_model.named_parameters())
    for name in (
        "mtp.0.main_proj.weight",
        "mtp.0.main_norm.weight",
        "mtp.2.norm.weight",
        "mtp.2.markov_head.embed.weight",
        "mtp.2.markov_head.head.weight",
        "mtp.2.confidence_head.proj.weight",
        "mtp.1.attn.wq_a.weight",
        "mtp.1.ffn.experts.3.w2.weight",
    ):
        assert name in names, name
    assert names["mtp.0.main_proj.weight"].abs().sum() > 0  # loaded, not left at init


def test_draft_block_is_greedy_over_markov_corrected_logits(tiny_model) -> None:
    cfg = tiny_model.config
    prompt = [0] + list(range(10, 40))
    out, _, state = _prefill(tiny_model, prompt)
    assert out.dspark_features.shape == (len(prompt), 3 * cfg.hidden_size)
    anchor = out.logits[-1].argmax().view(1)
    draft = tiny_model.draft(anchor, torch.tensor([len(prompt)]), torch.tensor([0]), state)
    size = cfg.dspark_block_size
    assert draft.drafts.shape == (1, size)
    assert draft.logits.shape == (1, size, cfg.vocab_size)
    assert torch.equal(draft.drafts, draft.logits.argmax(-1))
    assert ((draft.confidence > 0) & (draft.confidence < 1)).all()
    # The Markov head conditions step s on the previous draft: row s differs from the base logits
    # by exactly markov(prev_s).
    markov = tiny_model.mtp[-1].markov_head
    prev = torch.cat((anchor, draft.drafts[0, :-1]))
    expected = draft.base_logits[0] + markov.bias(prev)
    assert torch.allclose(draft.logits[0], expected, atol=1e-5)


def test_draft_reads_the_injected_context(tiny_model) -> None:
    prompt = [0] + list(range(10, 40))
    out, _, state = _prefill(tiny_model, prompt)
    anchor = out.logits[-1].argmax().view(1)
    args = (anchor, torch.tensor([len(prompt)]), torch.tensor([0]))
    first = tiny_model.draft(*args, state)
    for ring in state.draft_swa:
        ring.zero_()
    second = tiny_model.draft(*args, state)
    assert not torch.allclose(first.base_logits, second.base_logits)


def test_draft_sampling_is_seeded(tiny_model) -> None:
    prompt = [0] + list(range(50, 70))
    out, _, state = _prefill(tiny_model, prompt)
    anchor = out.logits[-1].argmax().view(1)
    args = (anchor, torch.tensor([len(prompt)]), torch.tensor([0]), state)
    temp = torch.tensor([1.0])
    a = tiny_model.draft(*args, temperature=temp, generator=torch.Generator().manual_seed(3))
    b = tiny_model.draft(*args, temperature=temp, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.drafts, b.drafts)
