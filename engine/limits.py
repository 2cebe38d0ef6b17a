"""`RequestLimits`: what bounds a single request on one engine (or one engine rank).

The scheduler refuses a request it can never run with these limits; the front end asks the
same question before admitting a request, so that the client gets a 400 instead of a failed
stream. Multi-process engines report one `RequestLimits` per rank at start; the front end
checks against the strictest (`RequestLimits.strictest`). Pure data, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """max_model_len: the context limit (prompt + output tokens).
    block_tokens / num_blocks: the global-KV pool (blocks of `block_tokens` tokens).
    max_context_len: the longest context one step fits in the activation memory budget
        (None: any).
    """

    max_model_len: int
    block_tokens: int
    num_blocks: int
    max_context_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.block_tokens < 1 or self.num_blocks < 0:
            raise ValueError(f"invalid request limits: {self}")

    @property
    def num_pool_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    @classmethod
    def strictest(cls, limits: Iterable[RequestLimits]) -> RequestLimits:
        """Limits a request meets only if it meets every one of `limits` (same block size)."""
        limits = list(limits)
        if not limits or len({lim.block_tokens for lim in limits}) != 1:
            raise ValueError("need at least one limits object, all with the same block size")
        contexts = [lim.max_context_len for lim in limits if lim.max_context_len is not None]
        return cls(
            max_model_len=min(lim.max_model_len for lim in limits),
            block_tokens=limits[0].block_tokens,
            num_blocks=min(lim.num_blocks for lim in limits),
            max_context_len=min(contexts) if contexts else None,
        )

    def rejection_reason(self, num_prompt: int, max_tokens: int | None) -> str | None:
        """Why a request of this prompt length and output limit (None: up to the context
        limit) can never run within these limits, or None."""
        max_model_len = self.max_model_len
        if num_prompt == 0:
            return "the prompt is empty: at least one prompt token is required"
        if max_tokens is None and num_prompt >= max_model_len:
            return (
                f"the prompt ({num_prompt} tokens) leaves no room to generate within the "
                f"context length ({max_model_len} tokens)"
            )
        if max_tokens is not None and num_prompt + max_tokens > max_model_len:
            return (
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"context length ({max_model_len} tokens)"
            )
        max_len = min(
            max_model_len, num_prompt + max_tokens if max_tokens is not None else max_model_len
        )
        # NOTE: the last token of a request is sampled but never computed, hence `max_len - 1`.
        num_blocks = -(-(max_len - 1) // self.block_tokens)
        if num_blocks > self.num_blocks:
            return (
                f"the request may reach {max_len} tokens, which needs {num_blocks} KV blocks, "
                f"but the whole cache holds {self.num_blocks} blocks ({self.num_pool_tokens} "
                "tokens)"
            )
        if self.max_context_len is not None and max_len - 1 > self.max_context_len:
            return (
                f"the request may reach {max_len} tokens, but a step over more than "
                f"{self.max_context_len} tokens of context exceeds the activation memory budget"
            )
        return None
