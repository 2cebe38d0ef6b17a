"""Greedy generation from the command line, straight on the model (no server, no engine).

    python -m engine.models --prompt "Hello" [--model default|tiny|PATH] [--max-tokens 16]

With a preset name the random-weight checkpoint is generated once into the cache folder. The
text is meaningless with random weights; this is a smoke test of the model and its state.
"""

from __future__ import annotations

import argparse
import time

import torch
from tokenizers import Tokenizer

from engine.models import load_model, sequential_batch
from engine.models.embedded import resolve_model_source


def main() -> None:
    parser = argparse.ArgumentParser(description="greedy generation on the model")
    parser.add_argument("--model", default="default", help="a preset name or a checkpoint folder")
    parser.add_argument("--prompt", default="Hello, world")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    folder = resolve_model_source(args.model)
    model = load_model(folder)
    tokenizer = Tokenizer.from_file(str(model.checkpoint_path / "tokenizer.json"))
    ids = [model.config.bos_token_id] + tokenizer.encode(args.prompt, add_special_tokens=False).ids
    batch, state = model.fresh_batch([ids + [0] * args.max_tokens])
    out = []
    step = sequential_batch([ids], [0], [0], batch.block_tables)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(args.max_tokens):
            logits = model.forward_step(step, state).logits[-1]
            token = int(logits.argmax())
            out.append(token)
            step = sequential_batch([[token]], [len(ids) + len(out) - 1], [0], batch.block_tables)
    elapsed = time.perf_counter() - start
    print(f"prompt ids: {ids}")
    print(f"generated ids: {out}")
    print(f"text: {tokenizer.decode(out)!r}")
    print(f"{len(out)} tokens in {elapsed:.2f} s")


if __name__ == "__main__":
    main()
