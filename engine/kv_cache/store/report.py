"""What a KV cache directory holds (`deepinfer-server --kv-cache-report DIR`): per namespace,
blocks and bytes by traffic class and by age, against a budget; expired blocks not yet
collected, crashed writers' temp files and the GC lease. Read-only (`scan` and `stat`, plus
reading `NAMESPACE.json` and `gc.lease`), so it can run on a live shared directory; files that
vanish while it scans are skipped.

A block file's mtime is its deadline and its atime its last access (`cache.md` §2.4: writes
and touches set both; reads move the atime on `relatime` mounts). The class is inferred from
`deadline − last access`: the class with the shortest TTL that covers it (a block last
extended by a chat request and read since by an agent may show as agent).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from engine.kv_cache.store.dirstore import LAYOUT
from engine.kv_cache.store.fileops import FileOps
from engine.kv_cache.store.gc import scan
from engine.kv_cache.store.ttl import TTLPolicy

AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1h", 3600.0),
    ("1h-1d", 86400.0),
    ("1d-3d", 3 * 86400.0),
    ("3d-7d", 7 * 86400.0),
    (">=7d", float("inf")),
)
UNKNOWN = "unknown"
_SLACK_S = 1.0  # mtime/atime rounding


@dataclass
class ClassRow:
    """Unexpired blocks of one class: count and bytes per age bucket (AGE_BUCKETS order)."""

    blocks: list[int] = field(default_factory=lambda: [0] * len(AGE_BUCKETS))
    bytes: int = 0


@dataclass
class NamespaceReport:
    namespace: str
    fields: dict
    num_blocks: int = 0
    used_bytes: int = 0
    expired_blocks: int = 0
    expired_bytes: int = 0
    temp_files: int = 0
    stale_temp_files: int = 0  # older than an hour: a crashed writer's (GC removes them)
    lease: str = "free"
    classes: dict[str, ClassRow] = field(default_factory=dict)


def infer_class(deadline: float, last_access: float, policy: TTLPolicy) -> str:
    """The class with the shortest TTL ≥ deadline − last access (within a second)."""
    remaining = deadline - last_access
    fitting = [(ttl, name) for name, ttl in policy.ttl_s.items() if ttl + _SLACK_S >= remaining]
    return min(fitting)[1] if fitting else UNKNOWN


def age_bucket(age_s: float) -> int:
    for index, (_, upper) in enumerate(AGE_BUCKETS):
        if age_s < upper:
            return index
    return len(AGE_BUCKETS) - 1


def directory_report(
    root: str, policy: TTLPolicy, now: float | None = None, ops: FileOps | None = None
) -> list[NamespaceReport]:
    """One report per namespace directory under `root` (as given to `--kv-cache-dir` or
    `--kv-cache-shared-dir`). Raises FileNotFoundError when `root` holds no KV cache layout."""
    ops = ops or FileOps()
    now = time.time() if now is None else now
    layout = os.path.join(root, LAYOUT)
    names = sorted(ops.listdir(layout))  # FileNotFoundError: not a cache directory
    reports = []
    for name in names:
        directory = os.path.join(layout, name)
        if not os.path.isdir(directory):
            continue
        report = NamespaceReport(name, _read_json(ops, os.path.join(directory, "NAMESPACE.json")))
        report.lease = _lease(ops, os.path.join(directory, "gc.lease"), now)
        entries, temps = scan(ops, directory)
        report.temp_files = len(temps)
        report.stale_temp_files = sum(1 for _, info in temps if info.st_mtime < now - 3600)
        for entry in entries:
            report.num_blocks += 1
            report.used_bytes += entry.size
            if entry.deadline <= now:
                report.expired_blocks += 1
                report.expired_bytes += entry.size
                continue
            last_access = entry.info.st_atime
            row = report.classes.setdefault(
                infer_class(entry.deadline, last_access, policy), ClassRow()
            )
            row.blocks[age_bucket(max(0.0, now - last_access))] += 1
            row.bytes += entry.size
        reports.append(report)
    return reports


def format_directory_report(
    root: str, reports: list[NamespaceReport], budget_bytes: int, policy: TTLPolicy
) -> str:
    """The text `--kv-cache-report` prints."""
    lines = [f"KV cache directory {root} (TTL {policy.describe()}, budget {_size(budget_bytes)} "
             f"per namespace)"]  # fmt: skip
    if not reports:
        lines.append("  no namespaces yet")
    for r in reports:
        fields = _describe(r.fields.get("fields", {}))
        lines.append(f"namespace {r.namespace}" + (f" ({fields})" if fields else ""))
        share = r.used_bytes / budget_bytes if budget_bytes else 0.0
        gc = (
            "above the 90 % high watermark: GC deletes down to 80 %"
            if share > 0.9
            else "below the GC watermark"
        )
        lines.append(
            f"  {r.num_blocks} blocks, {_size(r.used_bytes)} of {_size(budget_bytes)} "
            f"({share:.1%}; {gc})"
        )
        lines.append(
            f"  expired, not yet collected: {r.expired_blocks} blocks ({_size(r.expired_bytes)}); "
            f"temp files {r.temp_files} ({r.stale_temp_files} older than 1 h); GC lease {r.lease}"
        )
        header = "".join(f"{name:>9}" for name, _ in AGE_BUCKETS)
        lines.append(
            f"  {'class':<10}{'blocks':>9}{'bytes':>11}{header}   (by time since last access)"
        )
        for name in sorted(r.classes):
            row = r.classes[name]
            buckets = "".join(f"{n:>9}" for n in row.blocks)
            lines.append(f"  {name:<10}{sum(row.blocks):>9}{_size(row.bytes):>11}{buckets}")
    return "\n".join(lines)


def _read_json(ops: FileOps, path: str) -> dict:
    try:
        data, _ = ops.read(path)
        body = json.loads(data)
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _lease(ops: FileOps, path: str, now: float) -> str:
    body = _read_json(ops, path)
    if not body:
        return "free"
    try:
        left = float(body["expires"]) - now
    except (KeyError, TypeError, ValueError):
        return "unreadable"
    owner = body.get("owner", "?")
    return f"held by {owner} for {left:.0f} s more" if left > 0 else f"expired (was {owner})"


def _describe(fields: object) -> str:
    """A few identifying fields of NAMESPACE.json (the model's namespace has these)."""
    if not isinstance(fields, dict):
        return ""
    picks = (
        ("architecture", ("model", "architecture")),
        ("kv", ("kv_formats", "main", 0)),
        ("dtype", ("numerics", "dtype")),
        ("replay", ("numerics", "replay")),
    )
    parts = []
    for label, path in picks:
        value: object = fields
        for step in path:
            try:
                value = value[step]  # type: ignore[index]
            except (KeyError, IndexError, TypeError):
                value = None
                break
        if isinstance(value, str | int | float):
            parts.append(f"{label} {value}")
    return ", ".join(parts)


def _size(num: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{num} B"
