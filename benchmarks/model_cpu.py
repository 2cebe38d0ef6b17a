"""CPU benchmark of the model forward: prefill tokens/s and per-token decode time.

    python benchmarks/model_cpu.py [--models tiny default] [--prompt-len 512] [--decode-steps 32]

Writes each checkpoint once under --cache (default .cache/bench) with our random writer. Prints
one table. Numbers are for relative comparisons on one machine (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine.models import load_model, sequential_batch, write_random_checkpoint


def _checkpoint(name: str, cache: Path) -> Path:
    folder = cache / name
    if not (folder / "model.safetensors.index.json").is_file():
        write_random_checkpoint(name, folder, seed=0)
    return folder


@torch.inference_mode()
def bench(name: str, cache: Path, prompt_len: int, decode_steps: int, repeats: int) -> dict:
    model = load_model(_checkpoint(name, cache))
    g = torch.Generator().manual_seed(0)
    prompt = [0] + torch.randint(
        3, min(model.config.vocab_size, 100000), (prompt_len - 1,), generator=g
    ).tolist()
    prefill_times = []
    for _ in range(repeats):
        batch, state = model.fresh_batch([prompt + [1] * decode_steps])
        step = sequential_batch([prompt], [0], [0], batch.block_tables)
        step.logits_indices = torch.tensor([prompt_len - 1])
        t0 = time.perf_counter()
        out = model.forward_step(step, state)
        prefill_times.append(time.perf_counter() - t0)
    token = int(out.logits.argmax(-1))
    decode_times = []
    for i in range(decode_steps):
        step = sequential_batch([[token]], [prompt_len + i], [0], batch.block_tables)
        t0 = time.perf_counter()
        out = model.forward_step(step, state)
        decode_times.append(time.perf_counter() - t0)
        token = int(out.logits.argmax(-1))
    prefill = statistics.median(prefill_times)
    return {
        "model": name,
        "prompt": prompt_len,
        "prefill_s": prefill,
        "prefill_tok_s": prompt_len / prefill,
        "decode_ms": 1000 * statistics.median(decode_times[1:] or decode_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "default"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    print(
        f"{'model':8} {'prompt':>6} {'prefill s':>10} {'prefill tok/s':>14} {'decode ms/token':>16}"
    )
    for name in args.models:
        r = bench(name, args.cache, args.prompt_len, args.decode_steps, args.repeats)
        print(
            f"{r['model']:8} {r['prompt']:>6} {r['prefill_s']:>10.3f} {r['prefill_tok_s']:>14.1f} "
            f"{r['decode_ms']:>16.2f}"
        )


if __name__ == "__main__":
    main()
