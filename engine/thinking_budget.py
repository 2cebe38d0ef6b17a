"""ThinkingBudget: end a request's reasoning once it has generated a number of tokens (no torch).

A thinking request's output starts inside reasoning (its prompt ends in `<think>`). The budget
counts output tokens from there: when `max_tokens` of them are generated and none of them ended
the reasoning, the next token is forced to `end_token_id` (`</think>`); the sampler masks every
other token for that one draw. After it, or once the model ended its reasoning itself, the budget
does nothing.

    output   r0 r1 r2 ... r{B-1} | </think>  a0 a1 ...     B = max_tokens
             reasoning (B tokens)  forced    the answer
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudget:
    """max_tokens: reasoning tokens at most (0: the reasoning ends at once).
    end_token_id: the token forced when the budget is spent (`</think>`).
    ended_by: every token that ends the reasoning when the model generates it (`</think>`,
    and the tool-call marker where tools may be called); `end_token_id` is always one of them.
    """

    max_tokens: int
    end_token_id: int
    ended_by: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("thinking budget max_tokens must be >= 0")
        if self.end_token_id < 0 or any(t < 0 for t in self.ended_by):
            raise ValueError("thinking budget token ids must be >= 0")

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every id the budget refers to (checked against the vocabulary by the runner)."""
        return (self.end_token_id, *self.ended_by)

    def forced_token(self, output_token_ids: Sequence[int]) -> int | None:
        """The token the next draw must produce, or None (free choice).

        Only the draw at output index `max_tokens` can be forced, so the scan of the reasoning
        happens once per request.
        """
        if len(output_token_ids) != self.max_tokens:
            return None
        ends = {self.end_token_id, *self.ended_by}
        if any(token in ends for token in output_token_ids):
            return None
        return self.end_token_id
