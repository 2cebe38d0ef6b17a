"""The planner's step-time table (`dspark.md` §3.4) and the CUDA-graph tiers it is shaped by (§3.5).

    T(N, M) = T_draft(N) + T_verify(M) + α·N        (ms)

N requests draft, the target forward has M rows. `T_draft` is a step function over the draft
graphs' request buckets and `T_verify` one over the verify graphs' row tiers (a step pads to the
next captured size, and padding rows cost what real rows cost); above the last point both are
extrapolated linearly from their last two points. α is the per-request cost of attention and the
indexer at the profiled context, beyond what `T_verify` charges.

`profile_step_times` measures the table at start-up through two callables the engine gives it;
`load_table` / `save_table` keep it on disk keyed by (device name, model config hash, tiers,
draft buckets, profile context), so a restart on the same GPU and config does not re-profile.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TABLE_FORMAT = 1


def graph_tiers(max_rows: int) -> tuple[int, ...]:
    """Verify-graph row tiers up to `max_rows` (§3.5): every 8 rows to 64, every 16 to 256, every
    32 to 512, every 64 beyond; the last tier is the first one ≥ `max_rows`."""
    if max_rows < 1:
        raise ValueError("max_rows must be ≥ 1")
    tiers, m = [], 0
    while m < max_rows:
        m += 8 if m < 64 else 16 if m < 256 else 32 if m < 512 else 64
        tiers.append(m)
    return tuple(tiers)


def tier_for(rows: int, tiers: Sequence[int]) -> int | None:
    """The smallest tier ≥ `rows`, or None above the largest (the step runs eagerly)."""
    index = bisect.bisect_left(tiers, rows)
    return tiers[index] if index < len(tiers) else None


def _step_lookup(points: Sequence[int], values: Sequence[float], x: int) -> float:
    """Value at the first point ≥ x; linear extrapolation beyond the last point."""
    if x <= 0:
        return 0.0
    index = bisect.bisect_left(points, x)
    if index < len(points):
        return values[index]
    if len(points) == 1:
        return values[-1] * x / points[-1]
    slope = (values[-1] - values[-2]) / (points[-1] - points[-2])
    return values[-1] + max(slope, 0.0) * (x - points[-1])


@dataclass(frozen=True)
class StepTimeTable:
    """Profiled step times (ms). Both curves are non-decreasing (profiling takes running maxima).

    draft_buckets / draft_ms: request counts the draft graphs run at, and `T_draft` there.
    verify_tiers / verify_ms: verify-graph row tiers, and `T_verify` there.
    alpha_ms: per-request cost added to every step (α).
    """

    draft_buckets: tuple[int, ...]
    draft_ms: tuple[float, ...]
    verify_tiers: tuple[int, ...]
    verify_ms: tuple[float, ...]
    alpha_ms: float = 0.0

    def __post_init__(self) -> None:
        for points, values, name in (
            (self.draft_buckets, self.draft_ms, "draft"),
            (self.verify_tiers, self.verify_ms, "verify"),
        ):
            if not points or len(points) != len(values):
                raise ValueError(f"{name}: one time per point, at least one point")
            if any(b <= a for a, b in zip(points, points[1:], strict=False)) or points[0] < 1:
                raise ValueError(f"{name} points must be increasing positive ints")
            if any(b < a for a, b in zip(values, values[1:], strict=False)) or values[0] < 0:
                raise ValueError(f"{name} times must be non-negative and non-decreasing")
        if self.alpha_ms < 0:
            raise ValueError("alpha_ms must be ≥ 0")

    @property
    def largest_tier(self) -> int:
        return self.verify_tiers[-1]

    def tier_for(self, rows: int) -> int | None:
        return tier_for(rows, self.verify_tiers)

    def draft_time(self, num_requests: int) -> float:
        return _step_lookup(self.draft_buckets, self.draft_ms, num_requests)

    def verify_time(self, num_rows: int) -> float:
        return _step_lookup(self.verify_tiers, self.verify_ms, num_rows)

    def step_ms(self, num_requests: int, num_rows: int) -> float:
        """Predicted time of a step where `num_requests` draft and the target has `num_rows`
        rows (padded to the next tier inside the table, extrapolated above it)."""
        return (
            self.draft_time(num_requests)
            + self.verify_time(num_rows)
            + self.alpha_ms * num_requests
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepTimeTable:
        return cls(
            draft_buckets=tuple(int(x) for x in data["draft_buckets"]),
            draft_ms=tuple(float(x) for x in data["draft_ms"]),
            verify_tiers=tuple(int(x) for x in data["verify_tiers"]),
            verify_ms=tuple(float(x) for x in data["verify_ms"]),
            alpha_ms=float(data["alpha_ms"]),
        )


def _running_max(values: Sequence[float]) -> tuple[float, ...]:
    out, top = [], 0.0
    for value in values:
        top = max(top, value)
        out.append(top)
    return tuple(out)


@dataclass(frozen=True)
class ProfileConfig:
    """How `profile_step_times` measures: `repeats` timed calls per point after `warmup`
    untimed ones; verify tiers timed at ⌈m / rows_per_request⌉ requests; no point uses more
    than `max_requests` requests (None: the largest tier)."""

    repeats: int = 5
    warmup: int = 1
    rows_per_request: float = 3.5
    max_requests: int | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0 or self.rows_per_request < 1:
            raise ValueError("repeats ≥ 1, warmup ≥ 0 and rows_per_request ≥ 1")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be ≥ 1")


def profile_step_times(
    run_draft: Callable[[int], object],
    run_verify: Callable[[int, int], object],
    tiers: Sequence[int],
    draft_buckets: Sequence[int] | None = None,
    config: ProfileConfig | None = None,
    *,
    sync: Callable[[], object] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepTimeTable:
    """Measure the table by timing real forwards (§3.4).

    run_draft(n): one draft forward (draft block, Markov loop, confidence head) for n requests.
    run_verify(m, n): one target verify forward of m rows spread over n requests.
    Each callable may launch asynchronously; `sync()` waits for the device (torch.cuda.
    synchronize on CUDA) and is called before and after every timed call. `clock()` returns
    seconds. Each point is the median of `config.repeats` calls after the warm-up ones.

    T_verify(m) is timed at n = ⌈m / rows_per_request⌉ requests (a realistic mix of verify
    lengths, not the fewest requests m/6), minus α·n; α is the slope between n = ⌈m/6⌉ and n = m
    requests at the middle tier (≥ 0). Both curves are made monotone by running maxima.
    """
    config = config or ProfileConfig()
    tiers = tuple(sorted(set(int(t) for t in tiers)))
    buckets = tuple(sorted(set(int(b) for b in (draft_buckets or tiers))))
    if not tiers or not buckets or tiers[0] < 1 or buckets[0] < 1:
        raise ValueError("need at least one positive tier and draft bucket")

    def median_ms(call: Callable[[], object]) -> float:
        for _ in range(config.warmup):
            call()
        sync()
        times = []
        for _ in range(config.repeats):
            start = clock()
            call()
            sync()
            times.append((clock() - start) * 1e3)
        return statistics.median(times)

    limit = config.max_requests or tiers[-1]
    middle = tiers[len(tiers) // 2]
    few, many = min(limit, max(1, math.ceil(middle / 6))), min(limit, middle)
    alpha = 0.0
    if many > few:
        slow = median_ms(lambda: run_verify(middle, many))
        fast = median_ms(lambda: run_verify(middle, few))
        alpha = max(0.0, (slow - fast) / (many - few))
    verify = []
    for m in tiers:
        n = min(limit, max(1, math.ceil(m / config.rows_per_request)))
        verify.append(max(0.0, median_ms(lambda m=m, n=n: run_verify(m, n)) - alpha * n))
    draft = [median_ms(lambda n=n: run_draft(n)) for n in buckets]
    return StepTimeTable(
        draft_buckets=buckets,
        draft_ms=_running_max(draft),
        verify_tiers=tiers,
        verify_ms=_running_max(verify),
        alpha_ms=alpha,
    )


# ---------------------------------------------------------------- cache on disk


def config_hash(config: object) -> str:
    """A short stable hash of a (dataclass) model configuration."""
    data = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TableKey:
    """What a cached table is valid for; any difference means re-profiling."""

    device_name: str
    config_hash: str
    tiers: tuple[int, ...]
    draft_buckets: tuple[int, ...]
    context_len: int

    def file_name(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return f"step_times_{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def save_table(table: StepTimeTable, path: Path, key: TableKey) -> None:
    """Write `table` with its key (atomically: a temp file renamed over `path`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": TABLE_FORMAT, "key": dataclasses.asdict(key), "table": table.to_json()}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def load_table(path: Path, key: TableKey) -> StepTimeTable | None:
    """The table stored at `path` if it was profiled for `key`; None when the file is missing,
    unreadable, of another format or for another key (the caller re-profiles)."""
    try:
        payload = json.loads(path.read_text())
        if payload.get("format") != TABLE_FORMAT:
            return None
        stored = payload["key"]
        stored = {**stored, "tiers": tuple(stored["tiers"])}
        stored["draft_buckets"] = tuple(stored["draft_buckets"])
        if TableKey(**stored) != key:
            return None
        return StepTimeTable.from_json(payload["table"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_or_profile(
    cache_dir: Path, key: TableKey, profile: Callable[[], StepTimeTable]
) -> StepTimeTable | None:
    """The cached table for `key`, else `profile()` saved under `cache_dir`. A failing profile
    returns None after one warning: the planner then verifies all (§3.6)."""
    path = cache_dir / key.file_name()
    table = load_table(path, key)
    if table is not None:
        return table
    try:
        table = profile()
    except Exception as exc:  # noqa: BLE001 — any failure means "no table", never a crash
        log.warning("step-time profiling failed (%s): speculative steps verify every draft", exc)
        return None
    try:
        save_table(table, path, key)
    except OSError as exc:
        log.warning("could not cache the step-time table at %s: %s", path, exc)
    return table
