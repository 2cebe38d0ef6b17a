"""Cost of grammar-constrained decoding: per-step mask work and its effect on the step time.

    python benchmarks/structured.py [--model default] [--device cpu] [--mask-rows 1 32 256]
                                    [--dtype float32] [--step-rows 1 32] [--steps 8] [--repeats 3]
                                    [--json out.json]

Part 1, mask cost (no model): N matchers of a realistic JSON schema, each advanced along its own
random valid path so the rows are in different states, then per step: the batched bitmask fill
(xgrammar, host threads) and the apply on `[N, vocab]` fp32 logits on --device. Median of 20.

Part 2, step time (the model on --device): N decoding requests through `EngineCore.step()`,
(a) unconstrained, (b) constrained with the mask filled on the step's thread, (c) constrained
with the fill overlapping the forward (the default on a GPU). Median decode step time over
--steps steps after warm-up, best of --repeats interleaved runs; the overhead columns are
relative to (a).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.async_engine import AsyncEngine, EngineConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.structured import (
    BatchBitmask,
    CompiledConstraint,
    GrammarCompiler,
    RequestMatcher,
    apply_bitmask,
    spec_for_constraint,
    unpack_bitmask_row,
)

# Unbounded (notes can grow forever) so that decoding requests never finish during a run.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["new", "paid", "shipped"]},
        "total": {"type": "number"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
            "required": ["name", "email"],
        },
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "status", "total", "customer", "notes"],
}


def _median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _advanced_matchers(constraint: CompiledConstraint, rows: int, seed: int) -> list:
    """`rows` matchers, each moved 0..40 random allowed tokens into the document."""
    rng = random.Random(seed)
    scratch = torch.empty((1, (constraint.vocab_size + 31) // 32), dtype=torch.int32)
    matchers = []
    for _ in range(rows):
        matcher = constraint.new_matcher()
        for _ in range(rng.randrange(41)):
            matcher.fill_bitmask(scratch, 0)
            allowed = unpack_bitmask_row(scratch, 0, constraint.vocab_size).nonzero().flatten()
            choices = [t for t in allowed.tolist() if t != 1]  # never finish
            if not choices:
                break
            matcher.accept([rng.choice(choices)])
        matchers.append(matcher)
    return matchers


def mask_cost(constraint: CompiledConstraint, rows_list: list[int], device: str) -> list[dict]:
    bitmask = BatchBitmask(constraint.vocab_size)
    results = []
    for rows in rows_list:
        matchers: list[RequestMatcher | None] = _advanced_matchers(constraint, rows, seed=rows)
        logits = torch.randn(rows, constraint.vocab_size, device=device)
        mask = bitmask.fill(matchers)
        fill_ms = _median_ms(lambda m=matchers: bitmask.fill(m))

        def apply(mask=mask, logits=logits) -> None:
            apply_bitmask(logits, mask)
            if logits.is_cuda:
                torch.cuda.synchronize()

        apply_ms = _median_ms(apply)
        results.append({"rows": rows, "fill_ms": fill_ms, "apply_ms": apply_ms})
    return results


def _decode_step_ms(
    engine: AsyncEngine, rows: int, constraint: CompiledConstraint | None, steps: int
) -> float:
    core = engine.core
    vocab = core.runner.model.config.vocab_size
    g = torch.Generator().manual_seed(rows)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=steps + 8)
    request_ids = [f"b{rows}-{i}-{constraint is not None}" for i in range(rows)]
    for i, request_id in enumerate(request_ids):
        prompt = [0] + torch.randint(3, min(vocab, 100000), (31,), generator=g).tolist()
        core.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=prompt,
                params=params,
                seed=i,
                arrival_time=time.monotonic(),
                eos_token_id=engine.eos_token_id,
                constraint=constraint,
            )
        )
    for _ in range(3):  # prefill and warm-up decode steps
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        if core.runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    for request_id in request_ids:
        core.abort(request_id)
    while core.has_work():
        core.step()
    return statistics.median(times) * 1e3


def build_engines(
    model_name: str, device: str, dtype: str, max_rows: int
) -> dict[bool, AsyncEngine]:
    """Two engines over the same weights: mask fill on the step's thread (False) or overlapped."""
    engines: dict[bool, AsyncEngine] = {}
    for overlap in (False, True):
        config = EngineConfig(
            model=model_name,
            device=device,
            dtype=dtype,
            max_num_seqs=max_rows,
            kv_cache_tokens=max_rows * 256 + 4096,
            max_model_len=4096,
            overlap_grammar_mask=overlap,
        )
        if engines:
            engines[overlap] = AsyncEngine.from_model(engines[False].core.runner.model, config)
        else:
            engines[overlap] = AsyncEngine.from_config(config)
    return engines


def step_overhead(
    engines: dict[bool, AsyncEngine],
    constraint: CompiledConstraint,
    rows_list: list[int],
    steps: int,
    repeats: int,
) -> list[dict]:
    results = []
    for rows in rows_list:
        runs: dict[str, list[float]] = {"free": [], "serial": [], "overlap": []}
        for _ in range(repeats):  # interleaved, so drifting machine load hits all three alike
            runs["free"].append(_decode_step_ms(engines[True], rows, None, steps))
            runs["serial"].append(_decode_step_ms(engines[False], rows, constraint, steps))
            runs["overlap"].append(_decode_step_ms(engines[True], rows, constraint, steps))
        free, serial, overlapped = (min(runs[name]) for name in ("free", "serial", "overlap"))
        results.append(
            {
                "rows": rows,
                "free_ms": free,
                "serial_ms": serial,
                "overlap_ms": overlapped,
                "serial_overhead": serial / free - 1,
                "overlap_overhead": overlapped / free - 1,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    parser.add_argument("--mask-rows", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--step-rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    engines = build_engines(args.model, args.device, args.dtype, max(args.step_rows))
    model = engines[False].core.runner.model
    tokenizer = Tokenizer.from_file(str(Path(model.checkpoint_path) / "tokenizer.json"))
    vocab = model.config.vocab_size
    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab, model.config.eos_token_id)
    constraint = compiler.constraint(spec_for_constraint("json", json.dumps(SCHEMA)))
    threads = torch.get_num_threads()
    print(f"device {args.device} {args.dtype}, torch threads {threads}, vocab {vocab}")

    print("\nmask cost per step (median of 20)")
    print(f"{'rows':>6} {'fill ms':>10} {'apply ms':>10} {'per row µs':>11}")
    masks = mask_cost(constraint, args.mask_rows, args.device)
    for r in masks:
        per_row = (r["fill_ms"] + r["apply_ms"]) / r["rows"] * 1e3
        print(f"{r['rows']:>6} {r['fill_ms']:>10.2f} {r['apply_ms']:>10.2f} {per_row:>11.1f}")

    print(
        f"\ndecode step time, model {args.model} "
        f"(median of {args.steps} steps, best of {args.repeats} runs)"
    )
    print(
        f"{'rows':>6} {'free ms':>9} {'serial ms':>10} {'overlap ms':>11} "
        f"{'serial +%':>10} {'overlap +%':>11}"
    )
    steps = step_overhead(engines, constraint, args.step_rows, args.steps, args.repeats)
    for r in steps:
        print(
            f"{r['rows']:>6} {r['free_ms']:>9.1f} {r['serial_ms']:>10.1f} "
            f"{r['overlap_ms']:>11.1f} {r['serial_overhead'] * 100:>9.1f}% "
            f"{r['overlap_overhead'] * 100:>10.1f}%"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"mask": masks, "step": steps}, indent=2))


if __name__ == "__main__":
    main()
