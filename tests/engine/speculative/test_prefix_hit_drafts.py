"""The drafter after a prefix-cache hit reads what it reads after a cold prefill (`dspark.md`
§1.4, §1.12; `cache.md` §1.5), on `tiny` with the DSpark drafter.

After a hit the prefill computes only the replayed block and the new tokens; the drafter's
context window (the `sliding_window` positions before the anchor) must then hold rows written
for this request from those rows, never rows another request left in the slot. The slot is
poisoned first by a request with other tokens, so a stale row cannot pass by being zero.
"""

from __future__ import annotations

import pytest
import torch

from engine.core import EngineCore
from engine.request import Request
from engine.sampler import NoisePurpose
from engine.speculative.drafts import DraftRequests
from tests.engine.speculative.test_lossless import _core, _request

PROMPT_LEN = 300  # a 256-token hit: 128 replayed and 44 new rows, the decoder on the last 128


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 1000, (PROMPT_LEN,), generator=g).tolist()


def _prefill(core: EngineCore, request: Request) -> None:
    """Run `request` until its prompt is computed and its first token sampled."""
    core.add_request(request)
    while request.num_computed_tokens < len(request.prompt_token_ids):
        assert not request.is_finished, (request.request_id, request.status)
        core.step()
        core.scheduler.check_integrity()


def _finish(core: EngineCore, request: Request) -> None:
    _prefill(core, request)
    while core.has_work():
        core.step()


def _drafter_view(core: EngineCore, request: Request) -> dict[str, torch.Tensor]:
    """The context rows the drafter reads for `request`'s next block and the block it drafts."""
    model, state = core.runner.model, core.runner.state
    slot = core.scheduler.kv_manager.slot(request.request_id)
    p = request.num_computed_tokens
    window = range(max(0, p - model.config.sliding_window), p)
    view = {
        f"draft.{stage}": ring[slot, [q % ring.shape[1] for q in window]].float()
        for stage, ring in enumerate(state.draft_swa)
    }
    dev = model.device
    proposal = core.runner.speculative.drafts.propose(
        DraftRequests(
            anchors=torch.tensor([request.output_token_ids[-1]], device=dev),
            positions=torch.tensor([p], device=dev),
            slots=torch.tensor([slot], device=dev),
            seeds=torch.tensor([7], device=dev),
            temperatures=torch.zeros(1, device=dev),
            is_sampled=(False,),
            purpose=NoisePurpose.DRAFT,
        )
    )
    view["confidence"] = proposal.confidence.float()
    view["drafts"] = proposal.drafts
    return view


def _after_hit(model, swa_replay: str) -> tuple[EngineCore, Request]:
    core = _core(
        model,
        speculative="dspark",
        enable_prefix_caching=True,
        swa_replay=swa_replay,
        max_num_seqs=1,  # every request takes the poisoned slot
    )
    _finish(core, _request("first", _prompt(9), 4))  # caches the prompt's blocks
    _finish(core, _request("other", _prompt(5), 1))  # overwrites the slot's rings at 166..299
    hit = _request("hit", _prompt(9), 4)
    _prefill(core, hit)
    assert hit.num_cached_tokens >= 256, hit.num_cached_tokens
    return core, hit


def _cold(model, swa_replay: str) -> tuple[EngineCore, Request]:
    core = _core(model, speculative="dspark", swa_replay=swa_replay, max_num_seqs=1)
    cold = _request("cold", _prompt(9), 4)
    _prefill(core, cold)
    return core, cold


@pytest.mark.parametrize("swa_replay", ["exact", "bounded"])
def test_the_drafter_reads_the_same_rows_after_a_prefix_hit_as_after_a_cold_prefill(
    tiny_model_exact_kv, swa_replay: str
) -> None:
    model = tiny_model_exact_kv
    hit_core, hit = _after_hit(model, swa_replay)
    cold_core, cold = _cold(model, swa_replay)
    assert hit.output_token_ids == cold.output_token_ids
    mine, theirs = _drafter_view(hit_core, hit), _drafter_view(cold_core, cold)
    for name, value in mine.items():
        torch.testing.assert_close(value, theirs[name], rtol=1e-4, atol=1e-5, msg=name)
