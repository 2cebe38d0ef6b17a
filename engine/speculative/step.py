"""The runner's step with speculation on: draft → allocate → verify forward → accept → commit.

    chunks       decode rows with `num_draft_slots` (cap) > 0 draft; prefill chunks do not
    draft        DraftSource.propose(anchors at p)          → K drafts, logits q, confidences
                 (through the STS calibration when one is configured: the survivals)
    allocate     planner.allocate(survivals, caps, budget)  → L_r ≤ cap_r verified drafts;
                 a verify-all step (`draft_verify_all`) takes L_r = cap_r (the fixed path)
    forward      one ragged target forward: [anchor, d_1..d_L] at p..p+L, plus prefill chunks
    masks        per verify row (the grammar walks the drafts, `GrammarTracker.draft_mask`)
    accept       `acceptance.verify`: a_r accepted, a_r + 1 tokens emitted
    commit       draft context rows for committed positions (p..p+a), grammar on the emitted
                 tokens; the scheduler advances `num_computed_tokens` by 1 + a_r

Nothing is rolled back (`dspark.md` §1.11): every state row is addressed by absolute position,
so the rows written for rejected drafts (window rings, global KV, pending pairs, token history)
lie at positions ≥ the new anchor's and are rewritten before any query reads them. Only the
draft rings are written selectively: committed rows only.

A request with no drafts this step (cap 0, or a prefill chunk that samples) is verified as a
chain of length 0, which is the ordinary sampler's draw from its one row.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.model_runner import StepInFlight, token_logprobs
from engine.models import StepBatch, ints_to_device
from engine.outputs import (
    PLACEHOLDER_TOKEN_ID,
    ModelOutput,
    SamplingInfo,
    ScheduledChunk,
    SchedulerOutput,
    TokenLogprob,
)
from engine.sampler import NoisePurpose, SamplingBatch, process_logits
from engine.speculative.acceptance import SAMPLED_RULES, VerifyRows, block_draft_seeds, verify
from engine.speculative.config import SpeculativeConfig
from engine.speculative.drafts import DraftRequests, DraftSource, Proposal
from engine.speculative.metrics import SpeculativeMetrics
from engine.speculative.planner import allocate
from engine.speculative.records import AcceptanceRecord, RecordWriter, is_uncensored
from engine.speculative.sts import StsCalibration

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


@dataclass(frozen=True)
class _Plan:
    """Which chunks sample and how many drafts each verifies (host data)."""

    sampled: list[int]  # chunk indices that sample, in batch order
    is_drafting: list[bool]  # per sampled chunk: it drafted (owns a row of the proposal)
    lengths: list[int]  # L per sampled chunk
    drafts: list[list[int]]  # the L verified drafts per sampled chunk
    survivals: dict[str, tuple[float, ...]]  # per drafting request, its K survivals


class SpeculativeInFlight:
    """One speculative step launched and not yet collected (`SpeculativeStep.launch`): the
    host plan and the device tensors its acceptance reads. `timer` times its device work
    (`StepInFlight.timed`: CUDA events, or the host clock on the CPU). Only `output`, `failed`
    and `timer` are set for a step with nothing to run."""

    def __init__(
        self,
        output: SchedulerOutput,
        failed: dict[str, str],
        timer: StepInFlight,
        proposal: Proposal | None = None,
        plan: _Plan | None = None,
        batch: StepBatch | None = None,
        chunks: list[ScheduledChunk] | None = None,
    ) -> None:
        self.output = output
        self.failed = failed
        self.timer = timer
        self.proposal = proposal
        self.plan = plan
        self.batch = batch
        self.chunks = chunks or []
        self.request_ids = [c.request_id for c in self.chunks]
        self.features: torch.Tensor | None = None
        self.feature_rows: StepBatch | None = None  # the rows of `features` (None: `batch`)
        self.sampling: SamplingBatch | None = None
        self.rows: VerifyRows | None = None


class SpeculativeStep:
    """`ModelRunner.execute` when speculation is on (see the module docstring), in two
    phases for async scheduling (`engine/speculative/overlap.py`): `launch` (draft, plan,
    verify forward, masks, sampling queued) and `collect` (acceptance, commit)."""

    def __init__(self, config: SpeculativeConfig, drafts: DraftSource) -> None:
        if config.num_speculative_tokens > drafts.num_drafts:
            raise ValueError(
                f"num_speculative_tokens ({config.num_speculative_tokens}) exceeds the drafter's "
                f"block of {drafts.num_drafts}"
            )
        self.config = config
        self.drafts = drafts
        self.metrics = SpeculativeMetrics(config.num_speculative_tokens)
        self.calibration = (
            None
            if config.calibration is None
            else StsCalibration.load(Path(config.calibration), config.num_speculative_tokens)
        )
        self.recorder = None if config.record is None else RecordWriter(Path(config.record))

    @torch.inference_mode()
    def execute(self, runner: ModelRunner, output: SchedulerOutput) -> ModelOutput:
        """One synchronous speculative step: `launch` then `collect`."""
        return self.collect(runner, self.launch(runner, output))

    @torch.inference_mode()
    def launch(
        self, runner: ModelRunner, output: SchedulerOutput, ahead: DraftsAhead | None = None
    ) -> SpeculativeInFlight:
        """Draft, choose the verified prefixes, and queue the verify forward, the masks and the
        sampling of every verify row on the device; the acceptance is left for `collect`.

        Waits on the device once, for the drafts and the planner's verify lengths (the ragged
        batch and the grammar masks are built from them on the host). Chunks that
        `invalid_chunks` refuses are left out and reported by `collect`. ahead: drafts queued
        by `draft_ahead` for this step, used where they match its drafting rows.
        """
        failed = runner.invalid_chunks(output)
        if failed:
            chunks = tuple(c for c in output.chunks if c.request_id not in failed)
            output = dataclasses.replace(output, chunks=chunks)
        if ahead is not None:
            timer = ahead.timer
        else:
            timer = StepInFlight(output, failed, on_cuda=runner.device.type == "cuda")
        if output.is_empty:
            return SpeculativeInFlight(output, failed, timer)
        # Drafts queued ahead were timed there; only the planner's ranking remains.
        with timer.timed() if ahead is None else contextlib.nullcontext():
            proposal, plan = self._draft(runner, output, ahead)
        verified = _with_drafts(output, plan)
        batch = runner.build_batch(verified)
        for chunk in output.chunks:
            runner.replay_rows = runner.replay_rows.add(chunk)
        rows = _logit_rows(batch.starts, plan)
        batch.logits_indices = ints_to_device(rows, runner.device)
        runner.restore_resume_slots(output)
        runner.restore_token_history(output)
        chunks = [output.chunks[i] for i in plan.sampled]
        infos = [c.sampling for c in chunks]
        row_infos = [
            _row_info(info, j)
            for info, n in zip(infos, plan.lengths, strict=True)
            for j in range(n + 1)
        ]
        with timer.timed():
            forward = runner.model.forward_step(batch, runner.state)
        logits = forward.logits
        grammar = runner.grammar_for(infos)
        ids = [c.request_id for c in chunks]
        if grammar is not None:
            grammar.apply_mask(grammar.draft_mask(ids, infos, plan.drafts), logits)
        sampling = SamplingBatch.from_infos(
            row_infos,
            runner.model.config.vocab_size,
            runner.device,
            eos_token_id=runner.model.config.eos_token_id,
        )
        with timer.timed():
            processed = process_logits(logits, sampling)
            targets = runner.sampler.draw(processed, sampling)
        step = SpeculativeInFlight(output, failed, timer, proposal, plan, batch, chunks)
        step.features, step.feature_rows = forward.dspark_features, forward.rows
        step.sampling = sampling
        step.rows = self._verify_rows(processed, targets, sampling, infos, plan, proposal)
        return step

    @torch.inference_mode()
    def collect(
        self, runner: ModelRunner, step: SpeculativeInFlight, dropped: Collection[str] = ()
    ) -> ModelOutput:
        """Accept (the step's wait for its verdict on the host), write the draft context of the
        committed rows, advance the grammar matchers of the rows not `dropped` (requests that
        ended while the step was in flight) on their committed tokens, and return the tokens."""
        if step.rows is None:
            return ModelOutput(sampled={}, logprobs={}, failed=step.failed)
        output, plan, chunks = step.output, step.plan, step.chunks
        with step.timer.timed():
            verdict = verify(step.rows)
        emitted = verdict.emitted
        ring_len = runner.state.draft_swa[0].shape[1]
        committed = _committed_rows(step.batch.starts, output, plan, verdict.accepted, ring_len)
        rows = step.batch if step.feature_rows is None else step.feature_rows
        if step.feature_rows is not None:
            committed = step.batch.rows_in_part(step.feature_rows, committed)
        runner.model.inject_draft_context(
            rows, step.features, runner.state, ints_to_device(committed, runner.device)
        )
        infos = [c.sampling for c in chunks]
        ids = [c.request_id for c in chunks]
        if runner.grammar is not None:
            kept = [i for i, rid in enumerate(ids) if rid not in dropped]
            runner.grammar.commit_tokens(
                [ids[i] for i in kept], [infos[i] for i in kept], [emitted[i] for i in kept]
            )
        proposal = step.proposal
        if self.recorder is not None and proposal is not None:
            self.recorder.write(self._records(proposal, infos, plan, verdict.accepted))
        self.metrics.observe(
            plan.is_drafting,
            plan.lengths,
            verdict.accepted,
            self.drafts.num_drafts,
        )
        return ModelOutput(
            sampled={rid: tokens for rid, tokens in zip(ids, emitted, strict=True)},
            logprobs=_logprobs(runner, step.rows.processed, step.sampling, chunks, plan, emitted),
            failed=step.failed,
            draft_survivals=plan.survivals,
        )

    # ---- phases -------------------------------------------------------------------------------

    def _draft(
        self, runner: ModelRunner, output: SchedulerOutput, ahead: DraftsAhead | None
    ) -> tuple[Proposal | None, _Plan]:
        """Draft for the chunks with draft slots (or take their rows of `ahead`); choose the
        verified prefix of each."""
        chunks = output.chunks
        sampled = [i for i, c in enumerate(chunks) if c.sampling is not None]
        drafting = [i for i in sampled if chunks[i].num_draft_slots > 0]
        lengths = dict.fromkeys(sampled, 0)
        verified: dict[int, list[int]] = {i: [] for i in sampled}
        survivals: dict[str, tuple[float, ...]] = {}
        proposal = None
        if drafting:
            dev = runner.device
            infos = [chunks[i].sampling for i in drafting]
            rows = [_DraftRow.of(chunks[i]) for i in drafting]
            proposal = None if ahead is None else ahead.select(rows)
            if proposal is None:
                proposal = self.drafts.propose(self._draft_requests(rows, dev))
            width = self.config.num_speculative_tokens
            raw = proposal.confidence[:, :width].float()
            if self.calibration is None:
                survival = raw.cumprod(1)
            else:
                survival = self.calibration.survivals(raw, [i.params.temperature for i in infos])
            if output.draft_verify_all:  # the fixed path: every cap, no ranking
                chosen = [chunks[i].num_draft_slots for i in drafting]
            else:
                caps = ints_to_device([chunks[i].num_draft_slots for i in drafting], dev)
                chosen = allocate(survival, caps, output.draft_budget).tolist()
            tokens = proposal.drafts[:, :width].tolist()
            for row, (i, n) in enumerate(zip(drafting, chosen, strict=True)):
                lengths[i] = n
                verified[i] = tokens[row][:n]
            survivals = {
                chunks[i].request_id: tuple(s)
                for i, s in zip(drafting, survival.tolist(), strict=True)
            }
        plan = _Plan(
            sampled=sampled,
            is_drafting=[i in set(drafting) for i in sampled],
            lengths=[lengths[i] for i in sampled],
            drafts=[verified[i] for i in sampled],
            survivals=survivals,
        )
        return proposal, plan

    @torch.inference_mode()
    def draft_ahead(
        self, runner: ModelRunner, ahead: SchedulerOutput, previous: ModelOutput
    ) -> DraftsAhead | None:
        """Queue the drafts of step `ahead` (scheduled while the step before it was in flight)
        on the device as soon as that step's tokens are known (`previous`), before `ahead` is
        resolved: its drafting rows' anchors and positions follow from the tokens each request
        emitted. `launch` takes the rows it needs (`DraftsAhead.select`); rows of requests that
        finished, or whose cap resolves to 0, are never used. Draws are keyed by (seed,
        position), so they do not depend on which rows drafted together."""
        rows = []
        for chunk in ahead.chunks:
            if not chunk.num_draft_slots:
                continue
            if chunk.token_ids[-1] != PLACEHOLDER_TOKEN_ID:
                rows.append(_DraftRow.of(chunk))
            elif tokens := previous.sampled.get(chunk.request_id):
                # NOTE: the row was placed as if the step before accepted no draft.
                position = chunk.start_position + len(tokens) - 1
                rows.append(_DraftRow(tokens[-1], position, chunk.slot, chunk.sampling))
        if not rows:
            return None
        timer = StepInFlight(ahead, {}, on_cuda=runner.device.type == "cuda")
        with timer.timed():
            proposal = self.drafts.propose(self._draft_requests(rows, runner.device))
        return DraftsAhead(rows, proposal, timer)

    def _draft_requests(self, rows: list[_DraftRow], dev: torch.device) -> DraftRequests:
        infos = [row.sampling for row in rows]
        coupled = self.config.acceptance == "coupled"
        positions = ints_to_device([row.position for row in rows], dev)
        seeds = sampling_seeds(infos, dev)
        if self.config.acceptance == "block":
            seeds = block_draft_seeds(seeds, positions)
        return DraftRequests(
            anchors=ints_to_device([row.anchor for row in rows], dev),
            positions=positions,
            slots=ints_to_device([row.slot for row in rows], dev),
            seeds=seeds,
            temperatures=torch.tensor(
                [info.params.temperature for info in infos], dtype=torch.float32, device=dev
            ),
            is_sampled=tuple(not info.params.is_greedy for info in infos),
            purpose=NoisePurpose.SAMPLE if coupled else NoisePurpose.DRAFT,
        )

    def _records(
        self,
        proposal: Proposal,
        infos: list[SamplingInfo],
        plan: _Plan,
        accepted: list[int],
    ) -> list[AcceptanceRecord]:
        """The uncensored request-steps of this step, with their raw confidences."""
        width = self.config.num_speculative_tokens
        confidence = proposal.confidence[:, :width].float().tolist()
        records, row = [], 0
        for info, drafted, n, a in zip(
            infos, plan.is_drafting, plan.lengths, accepted, strict=True
        ):
            if not drafted:
                continue
            if is_uncensored(n, a, width):
                records.append(AcceptanceRecord(tuple(confidence[row]), a, info.params.temperature))
            row += 1
        return records

    def _verify_rows(
        self,
        processed: torch.Tensor,
        targets: torch.Tensor,
        sampling: SamplingBatch,
        infos: list[SamplingInfo],
        plan: _Plan,
        proposal: Proposal | None,
    ) -> VerifyRows:
        """The flat verify rows: proposals, which rows test against q (by rejection or block
        verification), their draft logits."""
        dev = processed.device
        proposals: list[int] = []
        rejection: list[bool] = []
        q_rows: list[tuple[int, int, int]] = []  # (verify row, proposal row, draft index)
        proposal_row = 0
        for info, n, tokens, drafted in zip(
            infos, plan.lengths, plan.drafts, plan.is_drafting, strict=True
        ):
            uses_rejection = self.config.acceptance in SAMPLED_RULES and not info.params.is_greedy
            for j in range(n):
                if uses_rejection:
                    q_rows.append((len(proposals), proposal_row, j))
                proposals.append(tokens[j])
                rejection.append(uses_rejection)
            proposals.append(-1)
            rejection.append(False)
            proposal_row += drafted
        draft_logits = None
        if q_rows and proposal is not None and proposal.logits is not None:
            draft_logits = torch.zeros_like(processed)
            index = ints_to_device([r for r, _, _ in q_rows], dev)
            src = proposal.logits[
                ints_to_device([p for _, p, _ in q_rows], dev),
                ints_to_device([j for _, _, j in q_rows], dev),
            ]
            draft_logits.index_copy_(0, index, src)
        return VerifyRows(
            processed=processed,
            targets=targets,
            proposals=ints_to_device(proposals, dev),
            draft_logits=draft_logits,
            rejection=torch.tensor(rejection, dtype=torch.bool, device=dev),
            seeds=sampling.seeds,
            positions=sampling.positions,
            lengths=plan.lengths,
            sampled_rule="block" if self.config.acceptance == "block" else "rejection",
        )


def sampling_seeds(infos: list[SamplingInfo], device: torch.device) -> torch.Tensor:
    """Seeds as the sampler keys them (seed mod 2^64, two's complement)."""
    values = []
    for info in infos:
        v = info.seed & ((1 << 64) - 1)
        values.append(v - (1 << 64) if v >= 1 << 63 else v)
    return torch.tensor(values, dtype=torch.long, device=device)


@dataclass(frozen=True)
class _DraftRow:
    """What a drafting row's draws depend on: its anchor at `position`, slot, sampling."""

    anchor: int
    position: int
    slot: int
    sampling: SamplingInfo

    @classmethod
    def of(cls, chunk: ScheduledChunk) -> _DraftRow:
        position = chunk.start_position + len(chunk.token_ids) - 1
        return cls(chunk.token_ids[-1], position, chunk.slot, chunk.sampling)

    def key(self) -> tuple:
        params = self.sampling.params
        seed = self.sampling.seed
        return (self.anchor, self.position, self.slot, seed, params.temperature, params.is_greedy)


class DraftsAhead:
    """Drafts queued before their step was resolved (`SpeculativeStep.draft_ahead`)."""

    def __init__(self, rows: list[_DraftRow], proposal: Proposal, timer: StepInFlight) -> None:
        self.proposal = proposal
        self.timer = timer  # the draft forward's device time, which its step's time includes
        self._row_of = {row.key(): i for i, row in enumerate(rows)}

    def select(self, rows: list[_DraftRow]) -> Proposal | None:
        """The proposal rows of `rows`, in order; None unless every one was drafted ahead
        with the same anchor, position, slot and sampling."""
        index = [self._row_of.get(row.key()) for row in rows]
        if None in index:
            return None
        p = self.proposal
        at = ints_to_device(index, p.drafts.device)
        logits = None if p.logits is None else p.logits.index_select(0, at)
        return Proposal(p.drafts.index_select(0, at), logits, p.confidence.index_select(0, at))


def _row_info(info: SamplingInfo, j: int) -> SamplingInfo:
    """The sampling of verify row j: output index + j (position-keyed noise, min_tokens); a
    forced draw applies to row 0 only (the scheduler never lets later rows reach one)."""
    if j == 0:
        return info
    return dataclasses.replace(info, output_index=info.output_index + j, forced_token_id=None)


def _with_drafts(output: SchedulerOutput, plan: _Plan) -> SchedulerOutput:
    """`output` with each sampled chunk's verified drafts appended to its tokens."""
    chunks = list(output.chunks)
    for i, tokens in zip(plan.sampled, plan.drafts, strict=True):
        if tokens:
            chunks[i] = dataclasses.replace(chunks[i], token_ids=(*chunks[i].token_ids, *tokens))
    return dataclasses.replace(
        output, chunks=tuple(chunks), num_tokens=sum(len(c.token_ids) for c in chunks)
    )


def _logit_rows(starts: list[int], plan: _Plan) -> list[int]:
    """Flat rows that get logits: the last 1 + L rows of every sampled chunk."""
    rows: list[int] = []
    for i, n in zip(plan.sampled, plan.lengths, strict=True):
        end = starts[i + 1]
        rows.extend(range(end - 1 - n, end))
    return rows


def _committed_rows(
    starts: list[int], output: SchedulerOutput, plan: _Plan, accepted: list[int], tail: int
) -> list[int]:
    """Flat rows whose positions are committed (every original row; accepted drafts), each
    chunk's last `tail` (the draft ring's length) of them at most, for the draft context.

    NOTE: more than a ring's length of rows would write two positions to one ring row in a
    single indexed write, whose winner is unspecified."""
    extra = dict.fromkeys(range(len(output.chunks)), 0)
    for i, a in zip(plan.sampled, accepted, strict=True):
        extra[i] = a
    rows: list[int] = []
    for i, chunk in enumerate(output.chunks):
        first = starts[i]
        end = first + len(chunk.token_ids) + extra[i]
        rows.extend(range(max(first, end - tail), end))
    return rows


def _logprobs(
    runner: ModelRunner,
    processed: torch.Tensor,
    sampling: SamplingBatch,
    chunks: list[ScheduledChunk],
    plan: _Plan,
    emitted: list[list[int]],
) -> dict[str, list[TokenLogprob]]:
    """Each emitted token's logprob from the target row that produced it (row j emits token
    j of the run), as the ordinary sampler reports them."""
    if sampling.logprob_rows.size == 0:
        return {}
    row_tokens: list[int] = []
    for tokens, n in zip(emitted, plan.lengths, strict=True):
        row_tokens.extend(tokens + [tokens[-1]] * (n + 1 - len(tokens)))
    result = runner.sampler.logprobs_of(
        processed, ints_to_device(row_tokens, processed.device), sampling
    )
    counts = [(n + 1, len(tokens)) for n, tokens in zip(plan.lengths, emitted, strict=True)]
    return token_logprobs(result, row_tokens, chunks, counts)
