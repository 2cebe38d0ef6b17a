"""The CSA indexer's two selections (`attention.py` `_select`, `_candidate_blocks`) at real sizes.

    python3 benchmarks/indexer_topk.py [--device cpu|cuda] [--rows 1 16 64 256]
        [--context 8192 65536] [--repeats 5] [--threads 1] [--out DIR]

The indexer keeps `index_topk` (512) of its scores over the visible compressed positions (J =
context / ratio: ratio 1 and 2 layers) with `torch.topk(scores, k)`, best first; the candidate
source keeps `candidate_topk_blocks` (2048) of its J / 8 block maxima with `torch.topk` into a
mask. Scores are random fp32 rows of [rows, J] (rows = decode sequences or prefill tokens).
Variants, median µs per call: "topk" (what the model runs), "topk unsorted + sort k" (the same
best-first order from an unsorted selection: the same set, order equal unless scores tie),
"sort" (a full descending sort, what the selection would cost without topk), on CUDA "kernel"
(`kernels.index_topk`, what the kernel path runs: one launch, the torch path's −1 masking
included; the same indices where no scores tie; "kernel resident" the same with rows of up to
`RESIDENT_WIDTH` scores held in registers, read once instead of once per pass), and for the
candidate mask "kthvalue mask" (the k-th largest as a threshold: the same set unless the k-th
value ties). "same" says whether the variant returned the same indices in the same order (mask
variants: the same mask). Writes indexer_topk.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.models.deepseek_v41.config import DeepseekV41Config

RATIOS = (1, 2)


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


def _median(timer: Callable, fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(timer(fn) for _ in range(repeats))


def selection_variants(scores: torch.Tensor, k: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Ways to get the k best indices of each row, best first."""

    def topk() -> torch.Tensor:
        return scores.topk(k, dim=-1).indices

    def unsorted_then_sort() -> torch.Tensor:
        top = scores.topk(k, dim=-1, sorted=False)
        order = top.values.sort(dim=-1, descending=True).indices
        return top.indices.gather(-1, order)

    def full_sort() -> torch.Tensor:
        return scores.sort(dim=-1, descending=True).indices[:, :k]

    variants = {"topk": topk, "topk unsorted + sort k": unsorted_then_sort, "sort": full_sort}
    if scores.is_cuda:
        from kernels.index_topk import RESIDENT_WIDTH, index_topk

        variants["kernel"] = lambda: index_topk(scores, k)
        variants["kernel resident"] = lambda: index_topk(scores, k, resident_width=RESIDENT_WIDTH)
    return variants


def mask_variants(keys: torch.Tensor, k: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Ways to get the mask of the k best entries of each row (order does not matter)."""

    def topk() -> torch.Tensor:
        chosen = torch.zeros_like(keys, dtype=torch.bool)
        return chosen.scatter_(-1, keys.topk(k, dim=-1).indices, True)

    def unsorted() -> torch.Tensor:
        chosen = torch.zeros_like(keys, dtype=torch.bool)
        return chosen.scatter_(-1, keys.topk(k, dim=-1, sorted=False).indices, True)

    def kthvalue() -> torch.Tensor:
        kth = keys.kthvalue(keys.shape[-1] - k + 1, dim=-1, keepdim=True).values
        return keys >= kth

    return {"topk": topk, "topk unsorted": unsorted, "kthvalue mask": kthvalue}


def bench(
    name: str, variants: dict[str, Callable[[], torch.Tensor]], repeats: int, timer: Callable
) -> dict:
    reference = variants["topk"]()
    out = {}
    for variant, fn in variants.items():
        out[variant] = {
            "us": _median(timer, fn, repeats),
            "same": bool(torch.equal(fn(), reference)),
        }
    line = ", ".join(
        f"{v} {r['us']:,.0f} µs{'' if r['same'] else ' (differs)'}" for v, r in out.items()
    )
    print(f"{name:<36} {line}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = DeepseekV41Config()
    device = torch.device(args.device)
    timer = _timer(device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"device {device} ({machine}), torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, index_topk {cfg.index_topk}, candidate blocks "
        f"{cfg.candidate_topk_blocks} of {cfg.candidate_block_size}, median of {args.repeats}"
    )
    generator = torch.Generator().manual_seed(0)
    results = []
    for context in args.context:
        for rows in args.rows:
            for ratio in RATIOS:
                num_j = context // ratio
                scores = torch.randn(rows, num_j, generator=generator).to(device)
                k = min(cfg.index_topk, num_j)
                name = f"select ctx {context} r{ratio} rows {rows} J {num_j} k {k}"
                r = bench(name, selection_variants(scores, k), args.repeats, timer)
                results.append(
                    {"what": "select", "context": context, "ratio": ratio, "rows": rows, **r}
                )
            num_blocks = context // cfg.candidate_block_size
            keys = torch.randn(rows, num_blocks, generator=generator).to(device)
            k = min(cfg.candidate_topk_blocks, num_blocks)
            name = f"blocks ctx {context} rows {rows} n {num_blocks} k {k}"
            r = bench(name, mask_variants(keys, k), args.repeats, timer)
            results.append({"what": "blocks", "context": context, "rows": rows, **r})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "indexer_topk.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
