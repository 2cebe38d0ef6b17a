"""Per-run statistics of a load run: latency percentiles, throughput, errors, cache share."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from loadtest.runner import RunResult

PERCENTILES = (50, 90, 99)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(v) * 1e3 for p, v in zip(PERCENTILES, points, strict=True)}


def summarize(result: RunResult) -> dict[str, Any]:
    """Latencies in ms (p50/p90/p99 of TTFT, inter-token latency, time per output token and
    end-to-end over the successful requests; inter-token gaps pooled over all of them),
    throughput over the run's wall time, errors by status (plus requests cancelled at the end),
    the share of prompt tokens the server reported as cached, and the server's process CPU time
    per output token (None when the server does not publish `process_cpu_seconds_total`)."""
    ok = [r for r in result.records if r.ok]
    errors = Counter(r.status for r in result.records if not r.ok)
    if result.cancelled:
        errors["cancelled"] = result.cancelled
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    cpu = result.server_cpu_s
    cpu_per_token = cpu * 1e3 / output if cpu is not None and output else None
    wall = max(result.wall_s, 1e-9)
    return {
        "label": result.run.label,
        "requests": len(result.records) + result.cancelled,
        "succeeded": len(ok),
        "errors": dict(errors),
        "wall_s": result.wall_s,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": output / wall,
        "total_tokens_per_s": (prompt + output) / wall,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "cached_share": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "server_cpu_s": cpu,
        "server_cpu_ms_per_output_token": cpu_per_token,
        "ttft_ms": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _percentiles([gap for r in ok for gap in r.inter_token]),
        "tpot_ms": _percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": _percentiles([r.e2e for r in ok]),
    }


def table(summaries: list[dict[str, Any]]) -> str:
    """A short fixed-width table, one row per run."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    header = (
        f"{'run':<16} {'ok':>5} {'err':>4} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT p50/p90/p99 ms':>21} {'ITL p50/p99 ms':>15} {'TPOT p50 ms':>12} "
        f"{'E2E p50/p99 ms':>16} {'cached':>7} {'srv CPU ms/tok':>15}"
    )
    lines = [header]
    for s in summaries:
        ttft, itl, tpot, e2e = s["ttft_ms"], s["itl_ms"], s["tpot_ms"], s["e2e_ms"]
        lines.append(
            f"{s['label']:<16} {s['succeeded']:>5} {sum(s['errors'].values()):>4} "
            f"{s['requests_per_s']:>7.2f} {s['output_tokens_per_s']:>10.1f} "
            f"{ms(ttft['p50']) + '/' + ms(ttft['p90']) + '/' + ms(ttft['p99']):>21} "
            f"{ms(itl['p50']) + '/' + ms(itl['p99']):>15} {ms(tpot['p50']):>12} "
            f"{ms(e2e['p50']) + '/' + ms(e2e['p99']):>16} {s['cached_share']:>7.1%} "
            f"{ms(s['server_cpu_ms_per_output_token']):>15}"
        )
    return "\n".join(lines)
