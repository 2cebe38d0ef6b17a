"""Acceptance records for fitting STS (`sts.py`, `dspark.md` §3.7): per uncensored request-step,
the confidence head's raw confidences, the drafts accepted and the request's temperature.

A request-step is uncensored when its labels y_k = [k ≤ a] are known for every k ≤ K: it
verified all K drafts, or rejected one (every later label is 0 whatever was verified). One JSON
object a line: {"confidence": [c_1..c_K], "accepted": a, "temperature": t}.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AcceptanceRecord:
    confidence: tuple[float, ...]  # raw c_1..c_K (before calibration)
    accepted: int  # a, 0 ≤ a ≤ K
    temperature: float

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= len(self.confidence):
            raise ValueError(f"accepted {self.accepted} outside 0..{len(self.confidence)}")


def is_uncensored(verified: int, accepted: int, width: int) -> bool:
    """Labels known at every position: all `width` drafts verified, or one rejected."""
    return verified == width or accepted < verified


class RecordWriter:
    """Appends records to a JSON-lines file (flushed per step). One owner: the engine loop."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, records: Iterable[AcceptanceRecord]) -> None:
        lines = [
            json.dumps(
                {
                    "confidence": list(r.confidence),
                    "accepted": r.accepted,
                    "temperature": r.temperature,
                }
            )
            for r in records
        ]
        if lines:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> list[AcceptanceRecord]:
    """The records of a file `RecordWriter` wrote (ValueError naming the bad line)."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            records.append(
                AcceptanceRecord(
                    tuple(float(c) for c in data["confidence"]),
                    int(data["accepted"]),
                    float(data["temperature"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not an acceptance record ({exc})") from exc
    return records
