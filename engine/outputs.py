"""Plain data passed between the scheduler, the model runner and the async engine (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.step_budget import StepShape, num_leading_rows

# A token id not yet known on the host: the output a step in flight samples (async scheduling).
# It appears only in `ScheduledChunk.token_ids` and at the end of `SamplingInfo.history`; the
# runner replaces it with the id sampled on the device by the previous step.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class SamplingInfo:
    """What the runner needs to sample the token after a chunk's last row.

    output_index: index of the token being sampled among the request's outputs (its absolute
    position is prompt length + output_index); randomness is keyed by (seed, position).
    history: prompt + output token ids so far, present only when a penalty needs them (its
    last entry may be `PLACEHOLDER_TOKEN_ID`, resolved by the runner before sampling).
    constraint: the request's `CompiledConstraint` (opaque here), or None.
    forced_token_id: the one token this draw may produce (a spent thinking budget), or None.
    """

    params: SamplingParams
    seed: int
    output_index: int
    num_prompt_tokens: int
    history: tuple[int, ...] | None = None
    constraint: Any = None
    forced_token_id: int | None = None


@dataclass(frozen=True)
class PrefixRestore:
    """How a chunk of a request admitted on a prefix-cache hit differs from a plain prefill.

    Positions `[0, num_reused_tokens)` have their global KV in shared, read-only cached blocks:
    the chunk recomputes (replays) positions from `window_floor` on but writes no global KV
    below `num_reused_tokens`, and its window (SWA) reads see nothing below `window_floor`
    (the rings hold another sequence's rows there). `history_token_ids` are the tokens at
    positions `[window_floor − len, window_floor)`, for the token history (Engram) of the first
    replayed rows; the runner writes them when the chunk starts at `window_floor`.
    `decoder_tail` > 0: decoder bounded replay (`model.md` §7.1): only the chunk's last
    `decoder_tail` rows run the decoder layers, their decoder windows floored at the first of
    them (0: every row runs every layer).
    """

    window_floor: int
    num_reused_tokens: int
    history_token_ids: tuple[int, ...] = ()
    decoder_tail: int = 0


@dataclass(frozen=True)
class SlotRestore:
    """A resume slot the runner copies into the chunk's state slot before the chunk runs
    (`engine/kv_cache/resume.py`): `payload` is the snapshot (an opaque host buffer of the
    runner's), `tail_block` the pool block that receives the partial last block's KV (None:
    the snapshot ends on a block boundary)."""

    payload: Any
    tail_block: int | None


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions `start_position .. start_position + len(token_ids) − 1` of one request."""

    request_id: str
    slot: int
    block_table: tuple[int, ...]
    start_position: int
    token_ids: tuple[int, ...]
    sampling: SamplingInfo | None  # None: a prefill chunk that does not reach the end yet
    restore: PrefixRestore | None = None  # set while the chunk replays cached positions
    resume: SlotRestore | None = None  # set on the first chunk of a request resumed from a slot
    # Speculation: the most drafts this decode row may verify after its token (its blocks cover
    # them); the runner drafts and verifies L ≤ num_draft_slots, and `ModelOutput.sampled`
    # then holds 1 + (accepted drafts) tokens, all computed but the last.
    num_draft_slots: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work, decode rows first. Empty when nothing can run."""

    chunks: tuple[ScheduledChunk, ...]
    num_tokens: int
    finished_request_ids: tuple[str, ...] = ()  # freed since the last step (runner may drop state)
    draft_budget: int = 0  # speculation: drafts the step verifies, all requests together
    draft_verify_all: bool = True  # speculation: every cap is verified (the fixed path, no ranking)
    draft_step: int = -1  # speculation: the planner's index of this step (-1: no speculation)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def shape(self) -> StepShape:
        """The padded shape the step budget prices (sequences, longest chunk, furthest end,
        leading one-token rows)."""
        lengths = [len(c.token_ids) for c in self.chunks]
        return StepShape(
            len(self.chunks),
            max(lengths, default=0),
            max((c.start_position + len(c.token_ids) for c in self.chunks), default=0),
            num_leading_rows(lengths),
        )


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class ModelOutput:
    """Sampled tokens for every chunk that had `sampling` (several with speculation: the
    accepted drafts and the token after them).

    failed: request id -> why its chunk was not run (e.g. a token id outside the vocabulary);
    that request alone ends with an error, the others of the step proceed.
    """

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprob]]
    failed: dict[str, str] = field(default_factory=dict)
    # Speculation: each drafting request's survivals S_1..S_K (for the planner's lagged budget).
    draft_survivals: dict[str, tuple[float, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Delta:
    """New output of one request (one choice of a user request when n > 1).

    token_ids: the new tokens (possibly several per step); logprobs: one entry per new token
    when asked; num_prompt_tokens / num_output_tokens: cumulative counts; finish_reason set on
    the last delta; error: why a request was rejected or aborted, if it was; queue_time_s: on
    the first delta with tokens, seconds from arrival to first scheduling; num_cached_tokens:
    prompt tokens served from the prefix cache (usage's cached tokens).
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None
    queue_time_s: float | None = None
    num_cached_tokens: int = 0
