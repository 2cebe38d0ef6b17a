"""Latency against throughput across the runs of a sweep, as a PNG (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweep(summaries: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT, inter-token and end-to-end latency (p50 solid, p99 dashed) against output tokens/s,
    one point per run, labelled with the run's rate or concurrency.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from exc
    throughput = [s["output_tokens_per_s"] for s in summaries]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for axis, key, name in zip(
        axes,
        ("ttft_ms", "itl_ms", "e2e_ms"),
        ("time to first token", "inter-token", "end-to-end"),
        strict=True,
    ):
        for percentile, style in (("p50", "-o"), ("p99", "--s")):
            values = [s[key][percentile] for s in summaries]
            axis.plot(throughput, values, style, label=percentile)
        for x, s in zip(throughput, summaries, strict=True):
            axis.annotate(s["label"], (x, s[key]["p50"] or 0), fontsize=7, alpha=0.7)
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel(f"{name} latency (ms)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
