"""A request as the scheduler tracks it (pure Python, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled, disconnected, shut down or rejected


@dataclass(eq=False)
class Request:
    """One sequence to generate. `n > 1` is expanded by the engine into n requests.

    Counting rule: `num_computed_tokens` catches up with `all_token_ids`; the positions
    `[num_computed_tokens, len(all_token_ids))` are what the next step may compute. A request
    is decoding once only its last (sampled, not yet cached) token is left.

    In flight (async scheduling): a step handed out but not yet applied by `update` covers
    `num_inflight_tokens` positions after `num_computed_tokens` and will sample
    `num_output_placeholders` outputs not yet known on the host. The next step continues at
    `num_scheduled_tokens`; a position at or past `num_tokens` holds a placeholder that the
    runner fills with the id sampled on the device. With speculation the step in flight may also
    commit up to `num_inflight_drafts` more positions (its decode rows' draft slots: accepted
    drafts), so the next chunk starts somewhere in `num_scheduled_tokens + [0,
    num_inflight_drafts]` and is placed exactly by `Scheduler.resolve` once that step is
    applied. All three counts are 0 between steps of the synchronous loop.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: params.seed, or a random draw at admission
    arrival_time: float
    eos_token_id: int | None = None
    index: int = 0  # choice index within the user request (n > 1)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    num_output_placeholders: int = 0
    num_inflight_drafts: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    error: str | None = None
    first_scheduled_time: float | None = None  # time.monotonic() at first admission
    # The `engine.structured.CompiledConstraint` every output token must follow, or None. Opaque
    # to the scheduler (which never imports torch); the model runner holds the matcher.
    constraint: Any = None
    # Prefix cache (`engine/kv_cache/reuse.py`). cache_salt: requests share cached blocks only
    # with requests of the same salt. num_cached_tokens: prompt tokens whose KV came from the
    # cache at the first admission (what usage reports). The rest describe the latest admission:
    # positions < num_reused_tokens are in shared cached blocks, computing restarted (replay) at
    # replay_start, and the first num_indexed_blocks blocks of the table are indexed or done.
    cache_salt: str | None = None
    traffic_class: str | None = None  # the directory tiers' TTL class (None: chat)
    num_cached_tokens: int = 0
    num_reused_tokens: int = 0
    replay_start: int = 0
    num_indexed_blocks: int = 0
    block_keys: list[bytes] = field(default_factory=list)  # chain keys of full blocks, lazily
    # The `engine.kv_cache.resume.ResumeSlot` the request was admitted from, until its restore
    # has run (opaque here).
    resume_slot: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Positions computed or handed to a step in flight: where the next chunk starts."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus the outputs a step in flight will sample."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_tokens_total(self) -> int | None:
        """Token count (prompt + output) at which the request stops for length."""
        if self.params.max_tokens is None:
            return None
        return self.num_prompt_tokens + self.params.max_tokens
