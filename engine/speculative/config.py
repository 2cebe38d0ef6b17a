"""The speculative-decoding options (`--speculative`, `--num-speculative-tokens`, ...)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("off", "dspark")
VERIFY_MODES = ("scheduled", "fixed")
ACCEPTANCE_MODES = ("rejection", "block", "coupled")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: `dspark` drafts with the checkpoint's DSpark drafter; `off` decodes one token per
        step.
    num_speculative_tokens: drafts proposed per request and step (1 ≤ k ≤ the drafter's block).
    verify: how many drafts a step verifies: `fixed` all of them (up to each request's cap),
        `scheduled` the planner's budget (`engine/speculative/planner.py`).
    acceptance: sampled requests accept by `rejection` sampling, token by token, or by `block`
        verification (the drafts decided jointly, never fewer accepted in expectation; both give
        the distribution without speculation, `dspark.md` §2.2, §2.4), or `coupled` (draft and
        target share the Gumbel noise of each position: seeded output is the same bits as
        without speculation, §2.5).
    calibration: an STS calibration file (`engine/speculative/sts.py`, fitted for
        `num_speculative_tokens` drafts): the confidence head's outputs pass through it before
        the planner sees them; None = identity.
    record: a JSON-lines file the step appends (raw confidences, drafts accepted, temperature)
        to for every request-step that verified all its drafts: `python -m
        engine.speculative.sts fit` fits a calibration from it; None = no recording.
    """

    method: str = "off"
    num_speculative_tokens: int = 5
    verify: str = "scheduled"
    acceptance: str = "rejection"
    calibration: str | None = None
    record: str | None = None

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
        if not self.is_enabled and (self.calibration or self.record):
            raise ValueError(
                "--speculative-calibration and --speculative-record need --speculative dspark"
            )

    @property
    def is_enabled(self) -> bool:
        return self.method != "off"
