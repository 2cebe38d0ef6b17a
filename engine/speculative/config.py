"""The speculative-decoding options (`--speculative`, `--num-speculative-tokens`, ...)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("off", "dspark")
VERIFY_MODES = ("scheduled", "fixed")
ACCEPTANCE_MODES = ("rejection", "coupled")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: `dspark` drafts with the checkpoint's DSpark drafter; `off` decodes one token per
        step.
    num_speculative_tokens: drafts proposed per request and step (1 ≤ k ≤ the drafter's block).
    verify: how many drafts a step verifies: `fixed` all of them (up to each request's cap),
        `scheduled` the planner's budget (`engine/speculative/planner.py`).
    acceptance: sampled requests accept by `rejection` sampling (same distribution as without
        speculation) or `coupled` (draft and target share the Gumbel noise of each position:
        seeded output is the same bits as without speculation, `dspark.md` §2.5).
    """

    method: str = "off"
    num_speculative_tokens: int = 5
    verify: str = "scheduled"
    acceptance: str = "rejection"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, not {self.method!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(
                f"speculative verify must be one of {VERIFY_MODES}, not {self.verify!r}"
            )
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ValueError(
                f"speculative acceptance must be one of {ACCEPTANCE_MODES}, not {self.acceptance!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {k!r}")

    @property
    def is_enabled(self) -> bool:
        return self.method != "off"
