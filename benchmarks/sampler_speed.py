"""The sampler's top-k / top-p filter: the full sort it replaced against `process_logits` now.

    python3 benchmarks/sampler_speed.py [--device cpu|cuda] [--rows 1 16 64 256]
        [--vocab 129280] [--repeats 5] [--threads 1] [--dists peaked medium flat] [--out DIR]

Each case is one batch of `rows` identical-parameter rows of `vocab` fp32 logits, drawn as
`randn · scale` per distribution: peaked (scale 8: top_p 0.95 keeps tens of tokens), medium
(scale 4: thousands, wider than the topk candidates) and flat (scale 1: most of the vocabulary).
"old" is the filter as the sampler ran it before (one descending sort of every filter row, the
softmax of the sorted row, cumsum); "new" is `process_logits` (a copy plus the filter: topk
candidates, the sort only for rows whose nucleus is wider on CPU; on CUDA the cut-off search
kernel for top-p-alone rows and top_k above the candidates, never a sort). Both are timed on the
same logits, interleaved, median of `repeats` (CUDA: events after a warm-up). Reported per
case: µs per batch old and new, the speed-up, the median kept tokens per row and the rows whose
kept sets differ (old and new may differ only where the better tokens' mass is within rounding
of top_p; see `sorted_top_k_top_p_cutoffs` and `kernels.nucleus_cutoff.MASS_TOLERANCE`).
The primitives line times `sort` and `topk` at each candidate count alone and, on CUDA, the
search kernel (`kernels.nucleus_cutoff`, top_p 0.95 with and without top_k 50), on the first
distribution's logits. Writes sampler_speed.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.outputs import SamplingInfo
from engine.sampler import NUCLEUS_CANDIDATES, SamplingBatch, process_logits
from engine.sampling_params import SamplingParams

SCALES = {"peaked": 8.0, "medium": 4.0, "flat": 1.0}
CASES = {
    "top_p 0.95": dict(top_p=0.95),
    "top_p 0.9": dict(top_p=0.9),
    "top_p 0.5": dict(top_p=0.5),
    "top_k 50 + top_p 0.95": dict(top_k=50, top_p=0.95),
    "top_k 1000 + top_p 0.9": dict(top_k=1000, top_p=0.9),
    "top_k 50": dict(top_k=50),
}


def old_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The filter before the candidates (a copy of the logits, filtered in place)."""
    xs = logits.clone()
    vocab = xs.shape[1]
    if bool((top_p >= 1).all()):  # top-k alone: the k-th value
        values = xs.topk(int(top_k.max()), dim=-1).values
        return xs.masked_fill_(xs < values.gather(1, top_k - 1), -math.inf)
    values = xs.sort(dim=-1, descending=True).values
    rank = torch.arange(vocab, device=xs.device)
    in_top_k = rank < torch.where(top_k > 0, top_k, vocab)
    probs = values.masked_fill(~in_top_k, -math.inf).softmax(dim=-1)
    before = probs.cumsum(dim=-1).sub_(probs)
    keep = in_top_k & ((before < top_p) | (top_p >= 1))
    cutoff = values.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    return xs.masked_fill_(xs < cutoff, -math.inf)


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def cpu(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    def cuda(fn: Callable[[], object]) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3

    return cuda if device.type == "cuda" else cpu


def _batch(rows: int, vocab: int, params: SamplingParams, device: torch.device) -> SamplingBatch:
    infos = [
        SamplingInfo(params=params, seed=r, output_index=0, num_prompt_tokens=0)
        for r in range(rows)
    ]
    return SamplingBatch.from_infos(infos, vocab, device)


def bench_case(
    logits: torch.Tensor, params: SamplingParams, repeats: int, timer: Callable
) -> dict[str, float]:
    rows, vocab = logits.shape
    batch = _batch(rows, vocab, params, logits.device)
    top_k = torch.full((rows, 1), params.top_k, dtype=torch.int64, device=logits.device)
    top_p = torch.full((rows, 1), params.top_p, device=logits.device)
    old_out, new_out = old_filter(logits, top_k, top_p), process_logits(logits, batch)  # warm-up
    old_us, new_us = [], []
    for _ in range(repeats):
        old_us.append(timer(lambda: old_filter(logits, top_k, top_p)))
        new_us.append(timer(lambda: process_logits(logits, batch)))
    kept = torch.isfinite(new_out).sum(-1).float()
    differ = (torch.isfinite(old_out) != torch.isfinite(new_out)).any(-1)
    old_med, new_med = statistics.median(old_us), statistics.median(new_us)
    return {
        "old_us": old_med,
        "new_us": new_med,
        "speedup": old_med / new_med,
        "kept_median": kept.median().item(),
        "rows_differ": int(differ.sum()),
    }


def bench_primitives(logits: torch.Tensor, repeats: int, timer: Callable) -> dict[str, float]:
    """sort and topk alone; on CUDA also the cut-off search kernel (`kernels.nucleus_cutoff`)
    for top_p 0.95 alone and with top_k 50 (its count search), which replaces the sort."""
    rows = logits.shape[0]
    primitives = [
        ("sort", lambda: logits.sort(dim=-1, descending=True)),
        *((f"topk({n})", lambda n=n: logits.topk(n, dim=-1)) for n in NUCLEUS_CANDIDATES),
    ]
    if logits.is_cuda:
        from kernels.nucleus_cutoff import nucleus_cutoffs

        top_p = torch.full((rows,), 0.95, device=logits.device)
        no_k = torch.zeros(rows, dtype=torch.int64, device=logits.device)
        k50 = torch.full_like(no_k, 50)
        primitives += [
            ("kernel(top_p)", lambda: nucleus_cutoffs(logits, no_k, top_p)),
            ("kernel(top_k 50 + top_p)", lambda: nucleus_cutoffs(logits, k50, top_p)),
        ]
    out = {}
    for name, fn in primitives:
        fn()  # warm-up
        out[name] = statistics.median(timer(fn) for _ in range(repeats))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dists", nargs="+", default=list(SCALES), choices=list(SCALES))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timer = _timer(device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"device {device} ({machine}), torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, vocab {args.vocab}, median of {args.repeats}"
    )
    results = []
    generator = torch.Generator().manual_seed(0)
    for rows in args.rows:
        base = torch.randn(rows, args.vocab, generator=generator).to(device)
        prim = bench_primitives(base * SCALES[args.dists[0]], args.repeats, timer)
        print(f"\nrows {rows}: " + ", ".join(f"{k} {v:,.0f} µs" for k, v in prim.items()))
        print(
            f"{'dist':<7} {'case':<24} {'old µs':>12} {'new µs':>12} {'speed-up':>9} "
            f"{'kept':>8} {'differ':>6}"
        )
        results.append({"rows": rows, "primitives": prim})
        for dist in args.dists:
            logits = base * SCALES[dist]
            for case in args.cases:
                r = bench_case(logits, SamplingParams(**CASES[case]), args.repeats, timer)
                print(
                    f"{dist:<7} {case:<24} {r['old_us']:>12,.0f} {r['new_us']:>12,.0f} "
                    f"{r['speedup']:>8.1f}x {r['kept_median']:>8.0f} {r['rows_differ']:>6}"
                )
                results.append({"rows": rows, "dist": dist, "case": case, **r})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampler_speed.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
