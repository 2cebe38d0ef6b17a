"""Peak RSS of the longest prompt the engine admits, prefilled under an activation budget.

    python benchmarks/prefill_memory.py [--model default] [--budget-gib 2] [--prompt-len N]
                                        [--target-step-ms 2000]

--prompt-len defaults to the longest prompt admitted (max_model_len - 1, max_tokens 1). Prints
the RSS before the prompt, the peak during it (sampled every 2 ms), the largest chunk, the
number of steps and the step budget; the bound to check is RSS before + the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampling_params import SamplingParams


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


class PeakRss:
    """Samples this process's RSS on a thread while the `with` block runs."""

    def __enter__(self) -> PeakRss:
        self.before = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def main_async(args: argparse.Namespace) -> None:
    config = EngineConfig(
        model=args.model,
        max_num_seqs=4,
        activation_memory_bytes=int(args.budget_gib * 2**30),
        target_step_ms=args.target_step_ms,
    )
    engine = AsyncEngine.from_config(config)
    chunks: list[int] = []
    update = engine.core.scheduler.update

    def recording_update(scheduled, model_output):
        chunks.extend(len(c.token_ids) for c in scheduled.chunks)
        return update(scheduled, model_output)

    engine.core.scheduler.update = recording_update
    max_len = engine.core.scheduler.config.max_model_len
    prompt_len = args.prompt_len or max_len - 1
    prompt = [0] + [3 + (7 * i) % 99000 for i in range(prompt_len - 1)]
    print(f"step budget: {engine.core.scheduler.step_budget.describe()}; max_model_len {max_len}")
    await engine.start()
    t0 = time.perf_counter()
    with PeakRss() as rss:
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=1), "long"):
            pass
    seconds = time.perf_counter() - t0
    await engine.shutdown()
    print(
        f"prompt {prompt_len} tokens: {seconds:.0f} s, {len(chunks)} steps, largest chunk "
        f"{max(chunks)}; RSS before {rss.before / 2**30:.2f} GiB, peak {rss.peak / 2**30:.2f} "
        f"GiB (+{(rss.peak - rss.before) / 2**30:.2f} GiB; budget {args.budget_gib} GiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--target-step-ms", type=float, default=None)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
