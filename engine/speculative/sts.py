"""Sequential temperature scaling (STS) of the confidence head (`dspark.md` §3.7).

The head's raw confidence c_k = sigmoid(ℓ_k) is overconfident; the planner's objective needs
absolute survivals S_k = Π_{i≤k} sigmoid(ℓ_i / T_i). `fit_sts` chooses T_1..T_L in order, each
on a log grid minimising the 15-bin ECE of S_k against the label "drafts 1..k all accepted",
with the earlier temperatures fixed. Dividing a logit by T > 0 keeps the order, so the ranking
of role 2 is unchanged by calibration; only the budget moves.

Labels come from steps where every draft was verified (uncensored) and must follow the
acceptance rule in force: one temperature vector per regime (`regime_of`). A calibration file
fitted for another number of drafts is refused.

Fitting from the engine's records (`--speculative-record PATH`, `records.py`):

    python -m engine.speculative.sts fit --records PATH [--records ...] --out CALIBRATION.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from engine.speculative.records import AcceptanceRecord, read_records

ECE_BINS = 15
DEFAULT_GRID = tuple(10 ** (-1 + i / 20) for i in range(41))  # 0.1 .. 10, 41 points
REGIMES = ("greedy", "sampled", "sampled_low_temp")
LOW_TEMPERATURE = 0.7


def regime_of(temperature: float) -> str:
    """The calibration regime of a request: greedy (T = 0), sampled (T ≥ 0.7) or low-T."""
    if temperature <= 0:
        return "greedy"
    return "sampled" if temperature >= LOW_TEMPERATURE else "sampled_low_temp"


def ece(prob: Tensor, label: Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error: Σ_bins (n_b / n)·|mean prob − mean label| over equal-width
    probability bins."""
    prob, label = prob.double().flatten(), label.double().flatten()
    if prob.numel() == 0:
        return 0.0
    index = (prob * bins).long().clamp(0, bins - 1)
    gap = torch.bincount(index, prob - label, minlength=bins).abs()  # n_b·|mean gap| per bin
    return float(gap.sum() / prob.numel())


def prefix_labels(accepted: Tensor, width: int) -> Tensor:
    """[n, width] float labels: y_k = 1 iff drafts 1..k were all accepted (k ≤ accepted)."""
    k = torch.arange(1, width + 1, device=accepted.device)
    return (k[None, :] <= accepted[:, None]).double()


def confidence_logits(confidence: Tensor) -> Tensor:
    """Raw logits ℓ of confidences in (0, 1) (clamped away from 0 and 1)."""
    c = confidence.double().clamp(1e-12, 1 - 1e-12)
    return torch.log(c) - torch.log1p(-c)


@dataclass(frozen=True)
class StsFit:
    """temperatures[k] divides draft k's logit; ece_before/after per position; num_samples."""

    temperatures: tuple[float, ...]
    ece_before: tuple[float, ...]
    ece_after: tuple[float, ...]
    num_samples: int

    def __post_init__(self) -> None:
        if not self.temperatures or any(not t > 0 for t in self.temperatures):
            raise ValueError("temperatures must be positive")

    @classmethod
    def identity(cls, width: int) -> StsFit:
        return cls((1.0,) * width, (0.0,) * width, (0.0,) * width, 0)

    @property
    def width(self) -> int:
        return len(self.temperatures)

    def calibrate(self, confidence: Tensor) -> Tensor:
        """Calibrated confidences [..., L] from raw ones (same shape, same order per position)."""
        temps = torch.tensor(self.temperatures, dtype=torch.float64, device=confidence.device)
        width = confidence.shape[-1]
        out = torch.sigmoid(confidence_logits(confidence) / temps[:width])
        return out.to(confidence.dtype)

    def survivals(self, confidence: Tensor) -> Tensor:
        """Calibrated survivals S_k = Π_{i≤k} c_i [..., L] (the planner's input)."""
        return self.calibrate(confidence).cumprod(-1)


def fit_sts(raw_logits: Tensor, labels: Tensor, grid: tuple[float, ...] = DEFAULT_GRID) -> StsFit:
    """Fit temperatures position by position (see the module docstring).

    raw_logits: [n, L] head logits from steps that verified every draft; labels: [n, L] prefix
    labels (`prefix_labels`). Ties on the grid go to the temperature nearest 1.
    """
    if raw_logits.shape != labels.shape or raw_logits.dim() != 2 or raw_logits.shape[0] == 0:
        raise ValueError("raw_logits and labels must be matching non-empty [n, L] tensors")
    logits, labels = raw_logits.double(), labels.double()
    survival = torch.ones(logits.shape[0], dtype=torch.float64, device=logits.device)
    raw_survival = survival.clone()
    temps, before, after = [], [], []
    for k in range(logits.shape[1]):
        raw_survival = raw_survival * torch.sigmoid(logits[:, k])
        before.append(ece(raw_survival, labels[:, k]))
        best = min(
            grid,
            key=lambda t: (
                ece(survival * torch.sigmoid(logits[:, k] / t), labels[:, k]),
                abs(math.log(t)),
            ),
        )
        survival = survival * torch.sigmoid(logits[:, k] / best)
        temps.append(float(best))
        after.append(ece(survival, labels[:, k]))
    return StsFit(tuple(temps), tuple(before), tuple(after), int(logits.shape[0]))


@dataclass(frozen=True)
class StsCalibration:
    """One `StsFit` per regime for `num_speculative_tokens` drafts (missing regime: identity)."""

    num_speculative_tokens: int
    fits: dict[str, StsFit]

    def __post_init__(self) -> None:
        for regime, fit in self.fits.items():
            if regime not in REGIMES:
                raise ValueError(f"unknown STS regime {regime!r}; one of {', '.join(REGIMES)}")
            if fit.width != self.num_speculative_tokens:
                raise ValueError(
                    f"the {regime} fit has {fit.width} temperatures, "
                    f"not {self.num_speculative_tokens}"
                )

    def fit_for(self, temperature: float) -> StsFit:
        regime = regime_of(temperature)
        return self.fits.get(regime) or StsFit.identity(self.num_speculative_tokens)

    def survivals(self, confidence: Tensor, temperatures: Sequence[float]) -> Tensor:
        """Calibrated survivals [N, L] of raw confidences [N, L ≤ num_speculative_tokens],
        row r by the fit of its request's regime (`temperatures[r]`)."""
        temps = torch.tensor(
            [self.fit_for(t).temperatures for t in temperatures],
            dtype=torch.float64,
            device=confidence.device,
        ).reshape(len(temperatures), self.num_speculative_tokens)
        width = confidence.shape[-1]
        calibrated = torch.sigmoid(confidence_logits(confidence) / temps[:, :width])
        return calibrated.cumprod(-1).to(confidence.dtype)

    def save(self, path: Path) -> None:
        payload = {
            "num_speculative_tokens": self.num_speculative_tokens,
            "fits": {
                regime: {
                    "temperatures": list(fit.temperatures),
                    "ece_before": list(fit.ece_before),
                    "ece_after": list(fit.ece_after),
                    "n": fit.num_samples,
                }
                for regime, fit in self.fits.items()
            },
        }
        path.write_text(json.dumps(payload, indent=1))

    @classmethod
    def load(cls, path: Path, num_speculative_tokens: int) -> StsCalibration:
        """Read a calibration file; ValueError when it was fitted for another number of drafts
        (or is unreadable or malformed)."""
        try:
            payload = json.loads(path.read_text())
            stored = int(payload["num_speculative_tokens"])
            fits = {
                regime: StsFit(
                    tuple(float(t) for t in data["temperatures"]),
                    tuple(data["ece_before"]),
                    tuple(data["ece_after"]),
                    int(data["n"]),
                )
                for regime, data in payload["fits"].items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not an STS calibration file ({exc})") from exc
        if stored != num_speculative_tokens:
            raise ValueError(
                f"{path}: STS temperatures fitted for {stored} drafts, not "
                f"{num_speculative_tokens} (--num-speculative-tokens)"
            )
        return cls(stored, fits)


MIN_SAMPLES = 50  # a regime with fewer uncensored records keeps the identity


def fit_records(
    records: Sequence[AcceptanceRecord], min_samples: int = MIN_SAMPLES
) -> StsCalibration:
    """One `StsFit` per regime with at least `min_samples` records (all of one width)."""
    widths = {len(r.confidence) for r in records}
    if len(widths) != 1:
        raise ValueError(f"records of one draft count needed, got widths {sorted(widths)}")
    (width,) = widths
    fits = {}
    for regime in REGIMES:
        mine = [r for r in records if regime_of(r.temperature) == regime]
        if len(mine) < min_samples:
            continue
        confidence = torch.tensor([r.confidence for r in mine], dtype=torch.float64)
        accepted = torch.tensor([r.accepted for r in mine])
        fits[regime] = fit_sts(confidence_logits(confidence), prefix_labels(accepted, width))
    return StsCalibration(width, fits)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.speculative.sts")
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="fit STS temperatures from acceptance records")
    fit.add_argument("--records", type=Path, action="append", required=True)
    fit.add_argument("--out", type=Path, required=True)
    fit.add_argument("--min-samples", type=int, default=MIN_SAMPLES)
    args = parser.parse_args(argv)
    records = [r for path in args.records for r in read_records(path)]
    if not records:
        print("no records", file=sys.stderr)
        return 1
    calibration = fit_records(records, args.min_samples)
    calibration.save(args.out)
    for regime, fitted in calibration.fits.items():
        temps = ", ".join(f"{t:.3g}" for t in fitted.temperatures)
        before = ", ".join(f"{e:.3f}" for e in fitted.ece_before)
        after = ", ".join(f"{e:.3f}" for e in fitted.ece_after)
        print(f"{regime}: n={fitted.num_samples} T=[{temps}] ECE [{before}] -> [{after}]")
    if not calibration.fits:
        print(f"no regime has {args.min_samples} records: identity", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
