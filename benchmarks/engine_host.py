"""Host time of the engine's per-step bookkeeping, no forward: one table.

    python benchmarks/engine_host.py [--model tiny] [--rows 1 64 256] [--prompt-len 512]
                                     [--steps 40] [--repeats 3] [--profile ROWS]

Builds the engine as the server does (`AsyncEngine.from_config`: the real `Scheduler`,
`KVCacheManager` with its `PrefixCache`, `PrefixReuse` with the host tier and resume slots,
`StepBudget`, and a `ModelRunner` of `--model` on the CPU), puts `rows` requests into decode
and then drives the async engine's order of host work by hand, with the sampled ids made up
(a fixed token, never a stop) instead of a forward:

    schedule N+1 │ build_batch N+1 (placeholders from N) │ update N │ sampling metadata N+1

Per step it times `Scheduler.schedule`, `Scheduler.update`, `ModelRunner.build_batch` and
`ModelRunner.sampling_batch` (the sampling metadata, `SamplingBatch.from_infos`), and prints
milliseconds per step (the median step of the fastest of `--repeats` runs of `--steps` steps
each, per phase), in CPU time of the engine's thread (`time.thread_time`), so that other
processes on a shared machine count as little as they can. Rows:

    decode R       R running requests, each decoding one token per step
    mixed R+P      the same, plus P waiting prompts admitted as prefill chunks in the step
    finish R       the step whose update finishes all R requests (all sample EOS at once),
                   their resume slots taken

`--profile R` prints a cProfile of the decode steps at R rows instead.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from dataclasses import dataclass

import torch

from engine.async_engine import DEFAULT_TARGET_STEP_MS, AsyncEngine, EngineConfig
from engine.model_runner import ModelRunner, StepInFlight
from engine.outputs import ModelOutput, SchedulerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_budget import CUDA_TIME_PRIOR, StepBudget, StepTimeModel

TOKEN = 7  # the made-up sampled id: not EOS, inside every vocabulary
PHASES = ("schedule", "update", "build_batch", "sampling")


@dataclass
class Bench:
    scheduler: Scheduler
    runner: ModelRunner
    prompt_len: int
    num_added: int = 0
    in_flight: tuple[SchedulerOutput, StepInFlight] | None = None
    token: int = TOKEN  # what every row "samples"

    def add(self, num: int, max_tokens: int, ignore_eos: bool = True) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        for _ in range(num):
            i = self.num_added
            self.num_added += 1
            prompt = [1000 + i % 50000, *range(1000, 1000 + self.prompt_len - 1)]
            self.scheduler.add_request(
                Request(
                    f"r{i}",
                    prompt,
                    params,
                    seed=i,
                    arrival_time=time.monotonic(),
                    eos_token_id=self.runner.model.config.eos_token_id,
                )
            )

    def step(self, times: dict[str, float] | None = None) -> int:
        """One step in the async engine's order; adds each phase's seconds to `times`.
        Returns the number of chunks scheduled."""
        clock = time.thread_time  # CPU time of this thread: other processes do not count
        t0 = clock()
        scheduled = self.scheduler.schedule()
        t1 = clock()
        step = StepInFlight(scheduled, {})
        if not scheduled.is_empty:
            previous = None if self.in_flight is None else self.in_flight[1]
            self.runner.build_batch(scheduled, previous)
            step.device_token_ids = torch.full((len(step.request_ids),), self.token)
        t2 = clock()
        if self.in_flight is not None:
            done, _ = self.in_flight
            sampled = {c.request_id: [self.token] for c in done.chunks if c.sampling is not None}
            self.scheduler.update(done, ModelOutput(sampled=sampled, logprobs={}))
        t3 = clock()
        infos = [c.sampling for c in step.sampled_chunks]
        if infos:
            self.runner.sampling_batch(infos)
        t4 = clock()
        self.in_flight = None if scheduled.is_empty else (scheduled, step)
        if times is not None:
            for name, seconds in zip(PHASES, (t1 - t0, t3 - t2, t2 - t1, t4 - t3), strict=True):
                times[name] += seconds
        return len(scheduled.chunks)

    def until_decoding(self) -> None:
        """Steps until every running request decodes (its prefill done) and none waits."""
        for _ in range(10_000):
            running = self.scheduler._running  # benchmark introspection only
            if not self.scheduler.num_waiting and all(
                r.num_computed_tokens + 1 >= r.num_tokens for r in running
            ):
                self.step()
                return
            self.step()
        raise RuntimeError("the requests never reached decode")

    def drain(self) -> None:
        while self.scheduler.has_unfinished_requests() or self.in_flight is not None:
            if self.step() == 0 and self.in_flight is None:
                continue


def build(model: str, rows: int, prompt_len: int) -> Bench:
    max_len = prompt_len + 4096
    config = EngineConfig(
        model=model,
        device="cpu",
        max_num_seqs=max(rows, 1) + 64,
        kv_cache_tokens=(max(rows, 1) + 64) * max_len,
        max_model_len=max_len,
        async_scheduling=True,
        host_kv_cache_bytes=256 << 20,
    )
    engine = AsyncEngine.from_config(config)
    scheduler = engine.core.scheduler
    # The H200's bounds: its time prior and target, a 60 GiB activation budget (the model's
    # own activation cost); the CPU's prior would cut every prefill to one token per step.
    scheduler.step_budget = StepBudget(
        scheduler.step_budget.memory,
        60 * 2**30,
        StepTimeModel(CUDA_TIME_PRIOR),
        DEFAULT_TARGET_STEP_MS["cuda"] / 1000.0,
    )
    return Bench(scheduler, engine.core.runner, prompt_len)


def measure(
    bench: Bench,
    rows: int,
    steps: int,
    *,
    num_prefills: int = 0,
    profiler: cProfile.Profile | None = None,
) -> dict[str, float]:
    """ms per step of each phase over `steps` steps with `rows` decoding requests (and, for
    a mixed step, `num_prefills` prompts added before each step); `profiler` runs during
    those steps only."""
    bench.add(rows, max_tokens=4096)
    bench.until_decoding()
    per_step = {name: [] for name in PHASES}
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        if num_prefills:
            bench.add(num_prefills, max_tokens=1)
        times = dict.fromkeys(PHASES, 0.0)
        bench.step(times)
        for name, seconds in times.items():
            per_step[name].append(seconds * 1e3)
    if profiler is not None:
        profiler.disable()
    for rid in list(bench.scheduler._requests):  # benchmark introspection only
        bench.scheduler.abort(rid)
    bench.drain()
    return {name: statistics.median(values) for name, values in per_step.items()}


def measure_finish(bench: Bench, rows: int) -> dict[str, float]:
    """ms of the one step whose update finishes all `rows` requests: they decode until every
    one of them does, then all sample EOS in the same step."""
    bench.add(rows, max_tokens=4096, ignore_eos=False)
    bench.until_decoding()
    eos = bench.runner.model.config.eos_token_id
    times = dict.fromkeys(PHASES, 0.0)
    worst = dict.fromkeys(PHASES, 0.0)
    bench.token = eos
    while bench.scheduler.num_running:
        for name in times:
            times[name] = 0.0
        bench.step(times)
        if times["update"] > worst["update"]:
            worst = dict(times)
    bench.token = TOKEN
    bench.drain()
    return {name: seconds * 1e3 for name, seconds in worst.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prefills", type=int, default=4, help="prompts in the mixed step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=None, metavar="ROWS")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench = build(args.model, max(args.rows), args.prompt_len)

    if args.profile is not None:
        measure(bench, args.profile, 5)
        profiler = cProfile.Profile()
        print(measure(bench, args.profile, args.steps, profiler=profiler))
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        print(text.getvalue())
        return

    cases = [(f"decode {r}", lambda r=r: measure(bench, r, args.steps)) for r in args.rows]
    top = max(args.rows)
    cases.append(
        (
            f"mixed {top}+{args.prefills}",
            lambda: measure(bench, top, args.steps, num_prefills=args.prefills),
        )
    )
    cases.append((f"finish {top}", lambda: measure_finish(bench, top)))
    runs = f"median step, fastest of {args.repeats} runs"
    print(f"host ms per step ({args.model} on the CPU, {runs})")
    header = f"{'step':>14} " + " ".join(f"{p:>11}" for p in PHASES) + f" {'total':>9}"
    print(header)
    for name, run in cases:
        run()  # warm-up
        runs = [run() for _ in range(args.repeats)]
        best = {p: min(r[p] for r in runs) for p in PHASES}
        total = sum(best.values())
        print(f"{name:>14} " + " ".join(f"{best[p]:11.3f}" for p in PHASES) + f" {total:9.3f}")


if __name__ == "__main__":
    main()
