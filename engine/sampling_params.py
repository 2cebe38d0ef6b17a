"""Per-request sampling parameters (OpenAI semantics), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.thinking_budget import ThinkingBudget

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how.

    temperature: 0 means greedy (argmax of the processed logits).
    top_p, top_k (0 = off), min_p: filters applied after temperature, in that order.
    presence_penalty / frequency_penalty (OpenAI, over generated tokens, subtracted from logits);
    repetition_penalty (HF/vLLM style, over prompt + generated tokens: positive logits divided,
    negative multiplied; 1.0 = off).
    logit_bias: token id → bias added to the raw logits (OpenAI range −100..100).
    n: independent completions of the same prompt.
    logprobs: return the sampled token's logprob; top_logprobs: that many alternatives (≤ 20).
    stop_token_ids: extra ids that end generation (the id is kept in the output).
    banned_token_ids: ids that are never generated (e.g. tool-call markup when no tools may be
    called).
    ignore_eos: do not stop at the model's EOS id.
    max_tokens: generated tokens at most (None = up to the context length).
    thinking_budget: reasoning tokens at most, then the reasoning-end token is forced
    (`engine/thinking_budget.py`); None = unbounded.
    seed: makes sampling reproducible for this request whatever else is in the batch.
    priority: lower value is scheduled first (FCFS within a priority).
    affinity_key: requests sharing a key share a prompt prefix (Responses `prompt_cache_key`):
    the placement hint for data-parallel ranks. A single-rank engine has nothing to place.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    stop_token_ids: tuple[int, ...] = ()
    banned_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    thinking_budget: ThinkingBudget | None = None
    seed: int | None = None
    priority: int = 0
    affinity_key: str | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "temperature must be >= 0")
        _check(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(self.top_k >= 0, "top_k must be >= 0 (0 disables it)")
        _check(0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty must be > 0")
        _check(self.n >= 1, "n must be >= 1")
        _check(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens must be >= 0")
        for token, bias in self.logit_bias.items():
            _check(isinstance(token, int) and token >= 0, "logit_bias keys must be token ids")
            _check(-100 <= bias <= 100, "logit_bias values must be in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_logprobs(self) -> int:
        """Alternatives to return per token (0 when logprobs are off)."""
        return self.top_logprobs if self.logprobs else 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
