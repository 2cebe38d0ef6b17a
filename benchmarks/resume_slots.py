"""Time to first token by turn of an agent conversation: resume slots vs block hits vs no cache.

    python benchmarks/resume_slots.py [--model default] [--device cpu] [--turns 6]
                                      [--first-len 2000] [--turn-len 300] [--output-len 32]
                                      [--conversations 2]

Each conversation's turn k+1 is turn k's prompt + the engine's own greedy answer + `--turn-len`
new token ids (the agent pattern at the token level, so no re-rendering hides a hit). The same
conversations run on three engines over one model, interleaved turn by turn so that all
three see the same machine load: `slots` (prefix cache + resume slots, the default),
`blocks` (prefix cache, `resume_slot_memory=0`, bounded replay) and `off` (no prefix cache).
Prints, per turn, the median TTFT of each engine and the cached tokens reported, and whether
the slot engine's greedy answers equal the uncached engine's (with encoded KV a decoded row and
a prefilled one can round differently, so on a random model they may part: `docs/model.md`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.models import load_model
from engine.models.embedded import resolve_model_source
from engine.sampling_params import SamplingParams

MODES = {
    "slots": {},
    "blocks": {"resume_slot_memory": 0},
    "off": {"enable_prefix_caching": False},
}


async def _one(engine: AsyncEngine, prompt: list[int], params, rid: str) -> tuple:
    t0 = time.perf_counter()
    first, tokens, cached = None, [], 0
    async for delta in engine.generate(prompt, params, rid):
        if first is None and delta.token_ids:
            first = time.perf_counter() - t0
        tokens += delta.token_ids
        cached = delta.num_cached_tokens
    return first, tokens, cached


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 100_000), (n,), generator=g).tolist()


async def main(args: argparse.Namespace) -> None:
    model = load_model(resolve_model_source(args.model), device=args.device, progress=False)
    # One chunk per prefill: chunk boundaries set by the timing-fitted step budget would
    # change float sums, and with them a random model's greedy answers, from run to run.
    base = {"model": args.model, "device": args.device, "max_num_seqs": 4}
    base["target_step_ms"] = 600_000.0
    max_len = args.first_len + args.turns * (args.turn_len + args.output_len) + 128
    base.update(max_model_len=max_len, kv_cache_tokens=4 * max_len + 256)
    engines = {
        m: AsyncEngine.from_model(model, EngineConfig(**base, **o)) for m, o in MODES.items()
    }
    for engine in engines.values():
        await engine.start()
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    firsts = [[0, *_ids(args.first_len - 1, 100 + c, vocab)] for c in range(args.conversations)]
    prompts = {m: list(firsts) for m in MODES}  # each engine continues its own answers
    ttft = {(m, k): [] for m in MODES for k in range(args.turns)}
    cached = {(m, k): [] for m in MODES for k in range(args.turns)}
    same = True
    try:
        for turn in range(args.turns):
            for c in range(args.conversations):
                outs = {}
                for mode, engine in engines.items():
                    outs[mode] = await _one(engine, prompts[mode][c], params, f"c{c}t{turn}")
                    ttft[mode, turn].append(outs[mode][0])
                    cached[mode, turn].append(outs[mode][2])
                    new = _ids(args.turn_len, 1000 * c + turn, vocab)
                    prompts[mode][c] = prompts[mode][c] + outs[mode][1] + new
                same &= outs["slots"][1] == outs["off"][1]
    finally:
        for engine in engines.values():
            await engine.shutdown()
    print(f"model {args.model} on {args.device}, first prompt {args.first_len} tokens, "
          f"+{args.turn_len} per turn, {args.output_len} output tokens, "
          f"{args.conversations} conversations")  # fmt: skip
    print("| turn | prompt tokens | TTFT slots ms | TTFT blocks ms | TTFT off ms | cached slots | "
          "cached blocks |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for turn in range(args.turns):
        length = args.first_len + turn * (args.output_len + args.turn_len)
        cells = [f"{statistics.median(ttft[m, turn]) * 1e3:,.0f}" for m in MODES]
        hits = [f"{statistics.median(cached[m, turn]):,.0f}" for m in ("slots", "blocks")]
        print(f"| {turn + 1} | {length:,} | " + " | ".join(cells + hits) + " |")
    print(f"slot engine's greedy answers equal the uncached engine's: {same}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-len", type=int, default=2000)
    parser.add_argument("--turn-len", type=int, default=300)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
