"""Speculative decoding is lossless at temperature 0 (`dspark.md` §5.2, tests 1 and 2), on `tiny`.

How multi-token commits are exercised honestly. With random weights the DSpark drafter almost
never agrees with the target, so a run with it commits one token per step and would not test
the verify path's widths. These tests therefore use two draft sources, both feeding the real
scheduler → runner → verify forward → acceptance → commit path:

* `ReferenceDrafts`: the drafts of position p are the non-speculative run's own tokens at
  p + 1.., with one token made wrong at a draft index that cycles with p (none every sixth
  step). Which drafts are accepted is still decided by the target's verify logits; a verify
  row whose logits differ from one-token decoding rejects a right draft or emits a different
  token, and the token comparison fails. Every commit width 1..K+1 occurs, at both parities.
* The product drafter (`DSparkDrafts`) on the same model: few drafts accepted, but the
  drafting, confidences and draft-context writes of the product path run.

Token equality needs batch-invariant numerics (`dspark.md` §4.5): with MXFP8/FP4 KV storage,
one-token decoding itself changes tokens with the batch's composition (a row's last-bit
difference moves a quantisation bucket), so these tests use exact KV storage.

State after each speculative step is compared with a one-token-at-a-time run stopped at the
same committed length: window rows, global KV and index keys, the pending ratio-2 pair, token
history (Engram) and the drafter's context rows, for every committed position they keep.
"""

from __future__ import annotations

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.core import EngineCore
from engine.models.deepseek_v41.state import BLOCK_TOKENS, TOKEN_RING
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.speculative.drafts import DraftRequests, Proposal
from engine.speculative.planner import BudgetDecision, PlannerMetrics

EOS_ID = 1


class ReferenceDrafts:
    """Drafts from known continuations (by slot), one wrong token at a draft index that cycles
    through 0..width with the slot's steps (index width: all verified drafts right), so every
    commit of 1..width + 1 tokens occurs."""

    num_drafts = 5

    def __init__(self, vocab_size: int, width: int = 5, *, first_wrong: bool = False) -> None:
        """first_wrong: the first draft is always wrong (every step commits one token)."""
        self.vocab_size = vocab_size
        self.width = width
        self.first_wrong = first_wrong
        self.references: dict[int, list[int]] = {}
        self.steps: dict[int, int] = {}

    def propose(self, requests: DraftRequests) -> Proposal:
        rows = []
        for p, slot in zip(requests.positions.tolist(), requests.slots.tolist(), strict=True):
            ref = self.references[slot]
            drafts = [ref[q] if q < len(ref) else 0 for q in range(p + 1, p + 6)]
            step = self.steps[slot] = self.steps.get(slot, -1) + 1
            wrong = 0 if self.first_wrong else step % (self.width + 1)
            if wrong < self.width:
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab_size
            rows.append(drafts)
        drafts = torch.tensor(rows, dtype=torch.long, device=requests.anchors.device)
        return Proposal(drafts, None, torch.full(drafts.shape, 0.5))


def _core(model, draft_source=None, **overrides) -> EngineCore:
    settings = {
        "max_num_seqs": 8,
        "kv_cache_tokens": 8192,
        "enable_prefix_caching": False,
        "max_model_len": 4096,
    }
    config = EngineConfig(model="tiny", **{**settings, **overrides})
    return AsyncEngine.from_model(model, config, draft_source=draft_source).core


def _request(rid: str, prompt: list[int], max_tokens: int, **params) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return Request(rid, prompt, sampling, seed=7, arrival_time=0.0, eos_token_id=EOS_ID)


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    lengths = [5 + 3 * i for i in range(count)]  # odd and even lengths: both start parities
    return [torch.randint(2, 1000, (n,), generator=g).tolist() for n in lengths]


def _run(core: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    while core.has_work():
        core.step()
        core.scheduler.check_integrity()
    return {r.request_id: list(r.output_token_ids) for r in requests}


_REFERENCES: dict[tuple, tuple[object, dict[str, list[int]]]] = {}


def _reference(model, prompts, max_tokens) -> dict[str, list[int]]:
    """The non-speculative run's tokens, computed once per (model, prompts, max_tokens): the
    parametrised tests ask for the same run (the model is kept, so its id stays its own)."""
    key = (id(model), tuple(map(tuple, prompts)), max_tokens)
    if key not in _REFERENCES:
        core = _core(model, speculative="off")
        requests = [_request(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
        _REFERENCES[key] = model, _run(core, requests)
    kept, tokens = _REFERENCES[key]
    assert kept is model
    return {rid: list(ids) for rid, ids in tokens.items()}


@pytest.mark.parametrize("num_speculative_tokens", [1, 2, 3, 4, 5])
def test_greedy_tokens_equal_one_token_decoding_at_every_verify_width(
    tiny_model_exact_kv, num_speculative_tokens: int
) -> None:
    """Verify widths 2..6 (width 1 is every prefill's sampling row and every cap-0 row);
    each request commits runs of every length up to the width, at both parities."""
    model = tiny_model_exact_kv
    prompts, max_tokens = _prompts(3), 64
    want = _reference(model, prompts, max_tokens)
    source = ReferenceDrafts(model.config.vocab_size, num_speculative_tokens)
    core = _core(model, source, speculative="dspark", num_speculative_tokens=num_speculative_tokens)
    requests = [_request(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
    _admit_with_references(core, requests, want, source)
    _run(core, [])
    assert {r.request_id: r.output_token_ids for r in requests} == want
    metrics = core.runner.speculative.metrics
    lengths = metrics.accept_length
    assert all(lengths[a] > 0 for a in range(1, num_speculative_tokens + 2)), lengths
    assert metrics.num_accepted >= metrics.num_request_steps // 3


def _admit_with_references(core, requests, want, source) -> None:
    """Add the requests, run their first (prefill) step, then tell the source each slot's
    reference continuation."""
    for request in requests:
        core.add_request(request)
    core.step()
    for request in requests:
        slot = core.scheduler.kv_manager.slot(request.request_id)
        source.references[slot] = request.prompt_token_ids + want[request.request_id]


@pytest.mark.slow  # ~9 s
def test_committed_state_equals_one_token_decoding_after_every_step(tiny_model_exact_kv) -> None:
    """After every speculative step (commits of 1..6 tokens), every state row the committed
    length keeps equals a one-token-at-a-time run's, for prompts of either parity."""
    model = tiny_model_exact_kv
    cfg = model.config
    max_tokens = 70
    widths: set[int] = set()
    for prompt in _prompts(2):
        want = _reference(model, [prompt], max_tokens)
        source = ReferenceDrafts(cfg.vocab_size)
        spec = _core(model, source, speculative="dspark", num_speculative_tokens=5)
        # One token per step, with the drafter's context written as speculation writes it.
        one_source = ReferenceDrafts(cfg.vocab_size, first_wrong=True)
        ref = _core(model, one_source, speculative="dspark", num_speculative_tokens=5)
        mine, theirs = _request("r0", prompt, max_tokens), _request("r0", prompt, max_tokens)
        _admit_with_references(spec, [mine], want, source)
        _admit_with_references(ref, [theirs], want, one_source)
        widths |= _commit_widths_with_equal_state(spec, ref, mine, theirs)
        assert mine.output_token_ids == want["r0"]
        assert ref.runner.speculative.metrics.num_accepted == 0
    assert widths >= {1, 2, 3, 4, 5, 6}, widths


def _state_rows(core: EngineCore, request_id: str, p: int) -> dict[str, torch.Tensor]:
    """Every state row a request's committed length p keeps (see the module docstring)."""
    model, state = core.runner.model, core.runner.state
    cfg = model.config
    slot = core.scheduler.kv_manager.slot(request_id)
    table = core.scheduler.kv_manager.block_table(request_id)
    window = range(max(0, p - cfg.sliding_window), p)
    rows: dict[str, torch.Tensor] = {}
    for layer, ring in enumerate(state.swa):
        rows[f"swa.{layer}"] = ring[slot, [q % ring.shape[1] for q in window]]
    for stage, ring in enumerate(state.draft_swa):
        rows[f"draft.{stage}"] = ring[slot, [q % ring.shape[1] for q in window]]
    for src, pool in state.global_kv.items():
        r = cfg.ratio(src)
        per_block = BLOCK_TOKENS // r
        index = range(p // r)
        blocks = [table[j * r // BLOCK_TOKENS] for j in index]
        rows[f"global.{src}"] = pool[blocks, [j % per_block for j in index]]
        rows[f"index.{src}"] = state.index_keys[src][blocks, [j % per_block for j in index]]
    if p % 2:
        for src, ring in state.pending.items():
            rows[f"pending.{src}"] = ring[slot, ((p - 1) // 2) % ring.shape[1]]
    rows["tokens"] = state.tokens[slot, [q % TOKEN_RING for q in range(max(0, p - 3), p)]]
    return rows


def _commit_widths_with_equal_state(spec, ref, mine, theirs) -> set[int]:
    """Step `spec` to the end of `mine`, and after each step `ref` (one token per step) up to
    the same position; the committed state of both must be equal there. Returns the widths
    (tokens committed per step) `spec` took."""
    widths: set[int] = set()
    while True:
        before = mine.num_computed_tokens
        spec.step()
        if mine.is_finished:
            return widths
        widths.add(mine.num_computed_tokens - before)
        while theirs.num_computed_tokens < mine.num_computed_tokens:
            ref.step()
        assert theirs.num_computed_tokens == mine.num_computed_tokens
        _assert_same_state(spec, ref, "r0", mine.num_computed_tokens)


def _assert_same_state(spec: EngineCore, ref: EngineCore, request_id: str, p: int) -> None:
    mine, theirs = _state_rows(spec, request_id, p), _state_rows(ref, request_id, p)
    for name, value in mine.items():
        torch.testing.assert_close(
            value.float(), theirs[name].float(), rtol=1e-4, atol=1e-5, msg=f"{name} at p={p}"
        )


def test_the_dspark_drafter_path_gives_the_tokens_of_one_token_decoding(
    tiny_model_exact_kv,
) -> None:
    """The product drafter on random weights: drafts rarely accepted, tokens unchanged."""
    model = tiny_model_exact_kv
    prompts, max_tokens = _prompts(3), 64
    want = _reference(model, prompts, max_tokens)
    core = _core(model, speculative="dspark")
    requests = [_request(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
    assert _run(core, requests) == want
    metrics = core.runner.speculative.metrics
    assert metrics.num_request_steps > 0 and metrics.num_verified > 0


@pytest.mark.parametrize("num_speculative_tokens", [1, 5])
@pytest.mark.slow  # the `default` model, 6-12 s
def test_default_model_greedy_tokens_and_state_equal_one_token_decoding(
    default_model_exact_kv, num_speculative_tokens: int
) -> None:
    """The `default` structure (40 layers, the 128-token window and its 134-row rings, the real
    vocabulary): prompts of both parities whose decodes wrap the window rings, verify widths 2
    and 6; tokens and every committed state row equal one-token decoding."""
    model = default_model_exact_kv
    g = torch.Generator().manual_seed(5)
    max_tokens = 32  # wraps the 134-row rings; widths 1..6 take 21 tokens (one cycle)
    widths: set[int] = set()
    for length in (127, 130):
        prompt = torch.randint(2, 120000, (length,), generator=g).tolist()
        want = _reference(model, [prompt], max_tokens)
        source = ReferenceDrafts(model.config.vocab_size, num_speculative_tokens)
        spec = _core(
            model, source, speculative="dspark", num_speculative_tokens=num_speculative_tokens
        )
        one_source = ReferenceDrafts(model.config.vocab_size, first_wrong=True)
        ref = _core(model, one_source, speculative="dspark", num_speculative_tokens=1)
        mine, theirs = _request("r0", prompt, max_tokens), _request("r0", prompt, max_tokens)
        _admit_with_references(spec, [mine], want, source)
        _admit_with_references(ref, [theirs], want, one_source)
        widths |= _commit_widths_with_equal_state(spec, ref, mine, theirs)
        assert mine.output_token_ids == want["r0"]
    assert widths == set(range(1, num_speculative_tokens + 2)), widths


class HalfPlanner:
    """A budget of half the drafts (rounded down): `allocate` then keeps the best-ranked half
    by the current survivals, so requests verify different prefix lengths in one step."""

    def __init__(self) -> None:
        self.metrics = PlannerMetrics()

    def budget(self, rows, prefill_rows: int) -> int:
        return sum(row.cap for row in rows) // 2

    def plan(self, rows, prefill_rows: int) -> BudgetDecision:
        budget = self.budget(rows, prefill_rows)
        return BudgetDecision(budget, is_verify_all=budget == sum(r.cap for r in rows))

    def observe(self, survivals, request_count: int) -> None:
        return None

    def record_step_time(self, decision, measured_ms: float) -> None:
        return None


def test_a_budget_below_all_drafts_stays_lossless(tiny_model_exact_kv) -> None:
    """Verifying fewer drafts than proposed (the scheduled planner's case, §2.3): tokens
    unchanged, fewer drafts verified than proposed."""
    model = tiny_model_exact_kv
    prompts, max_tokens = _prompts(3), 60
    want = _reference(model, prompts, max_tokens)
    source = RankedReferenceDrafts(model.config.vocab_size)
    core = _core(model, source, speculative="dspark")
    core.scheduler.speculation.planner = HalfPlanner()
    requests = [_request(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
    _admit_with_references(core, requests, want, source)
    _run(core, [])
    assert {r.request_id: r.output_token_ids for r in requests} == want
    metrics = core.runner.speculative.metrics
    assert 0 < metrics.num_verified < metrics.num_drafted and metrics.num_accepted > 0
    assert len({n for n in metrics.verified_per_position[1:] if n}) > 1


class RankedReferenceDrafts(ReferenceDrafts):
    """`ReferenceDrafts` with confidences that differ by slot, so the ranking splits the
    budget unevenly between requests."""

    def propose(self, requests: DraftRequests) -> Proposal:
        proposal = super().propose(requests)
        conf = (
            0.3
            + 0.2 * (requests.slots.float()[:, None] % 3)
            + torch.zeros_like(proposal.confidence)
        )
        return Proposal(proposal.drafts, proposal.logits, conf.clamp(max=0.95))
