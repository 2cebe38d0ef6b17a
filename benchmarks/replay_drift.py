"""Drift and prefill time of prefix-cache replays against a full prefill, over a conversation.

    python benchmarks/replay_drift.py [--model default] [--turns 4] [--threads 1]

A conversation grows turn by turn (the agent pattern: previous prompt + an 8-token answer + new
user tokens). Turn 1 is a miss (a full prefill). From turn 2 on, each mode hits the blocks of
its own previous turn at P (the previous prompt's full blocks, so drift accumulates across
hits as in the engine) and computes the replay `[P − R, S)` in another slot, whose windows
hold the previous turn's rows below the floor. Modes (`cache.md` §1.5, `model.md` §7):

    exact           R = layers × (window − 1) rounded up to blocks, every row runs every layer
    bounded-encoder R = 128, every row runs every layer (the replay before decoder replay)
    bounded         R = 128, the decoder runs only the last 128 rows (`--swa-replay bounded`)

Per turn and mode it prints the last position's logits against an uncached full prefill of the
same prompt (max |Δlogit|, relative L2 norm of Δ, same argmax), the rows each layer stack
computed, and the seconds of the hit step next to the full prefill's (median of `--repeats`
round-robin runs, forward only, logits of the last row); `margin` is the reference's gap
between its two largest logits (an argmax can flip only where it is small). Model: `--model`'s
random checkpoint, written once under `--cache` by our writer (as `benchmarks/model_cpu.py`).
Numbers: docs/model.md and docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models import StepBatch, load_model, write_random_checkpoint
from engine.models.deepseek_v41.state import BLOCK_TOKENS, write_token_history

MODES = ("exact", "bounded-encoder", "bounded")


@dataclass
class Hit:
    """One mode's hit step of one turn: its logits, the rows each stack computed, and the
    step itself (repeatable for timing: it rewrites only its own blocks, rings and history)."""

    logits: torch.Tensor
    encoder_rows: int
    decoder_rows: int
    step: Callable[[], torch.Tensor]
    seconds: float = 0.0


def _checkpoint(name: str, cache: Path) -> Path:
    folder = cache / name
    if not (folder / "model.safetensors.index.json").is_file():
        write_random_checkpoint(name, folder, seed=0)
    return folder


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 100000), (n,), generator=g).tolist()


def conversation(turns: int, first: int, vocab: int) -> list[list[int]]:
    """Prompts of `turns` turns: each is the previous + 8 answer tokens + 150–350 new ones."""
    prompts = [[0, *_tokens(first - 1, 1, vocab)]]
    for turn in range(1, turns):
        new = 150 + (97 * turn) % 200
        prompts.append(prompts[-1] + _tokens(8 + new, 100 + turn, vocab))
    return prompts


def _seconds(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Runner:
    """Sequences of the conversation in one state: slot `turn % 2`, blocks from a counter."""

    def __init__(self, model, max_len: int, turns: int) -> None:
        self.model = model
        self.blocks_per_seq = -(-max_len // BLOCK_TOKENS)
        self.state = model.allocate_state(2, self.blocks_per_seq * (turns + 1))
        self.next_block = 0

    def fresh_blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def table(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor([blocks + [-1] * (self.blocks_per_seq - len(blocks))])

    def step(self, tokens, start, slot, blocks, *, floor=None, reused=0, decoder_floor=None):
        batch = StepBatch(
            token_ids=torch.tensor(tokens),
            starts=[0, len(tokens)],
            start_positions=[start],
            slots=torch.tensor([slot]),
            block_tables=self.table(blocks),
            logits_indices=torch.tensor([len(tokens) - 1]),
            window_floors=None if floor is None else [floor],
            reuse_ends=None if floor is None else [reused],
            decoder_floors=None if decoder_floor is None else [decoder_floor],
        )
        with torch.inference_mode():
            return self.model.forward_step(batch, self.state).logits[0]


def full_prefill(model, prompt: list[int]) -> Hit:
    """The uncached reference: the whole prompt in one step from a fresh state."""
    runner = Runner(model, len(prompt), 0)
    blocks = runner.fresh_blocks(runner.blocks_per_seq)

    def step() -> torch.Tensor:
        return runner.step(prompt, 0, 0, blocks)

    return Hit(step(), len(prompt), len(prompt), step)


def _replay(runner: Runner, prompt, start, slot, blocks, hit, decoder_floor) -> torch.Tensor:
    """One hit step as the engine runs it: the token history before the replay (Engram's
    look-back; a step overwrites its slot's ring), then `[start, len(prompt))`."""
    history = max(0, start - 3)
    write_token_history(runner.state, slot, history, prompt[history:start])
    return runner.step(
        prompt[start:], start, slot, blocks, floor=start, reused=hit, decoder_floor=decoder_floor
    )


def run_mode(model, mode: str, prompts: list[list[int]]) -> list[Hit | None]:
    """The conversation under one mode: None for turn 1 (a miss), a `Hit` for the others."""
    replay = model.replay_tokens("exact" if mode == "exact" else "bounded")
    tail = model.decoder_tail_tokens("bounded") if mode == "bounded" else 0
    runner = Runner(model, len(prompts[-1]), len(prompts))
    blocks = runner.fresh_blocks(-(-len(prompts[0]) // BLOCK_TOKENS))
    runner.step(prompts[0], 0, 0, blocks)
    out: list[Hit | None] = [None]
    for turn in range(1, len(prompts)):
        prompt, hit = prompts[turn], len(prompts[turn - 1]) // BLOCK_TOKENS * BLOCK_TOKENS
        start, end = max(0, hit - replay), len(prompt)
        blocks = blocks[: hit // BLOCK_TOKENS]
        blocks += runner.fresh_blocks(-(-end // BLOCK_TOKENS) - len(blocks))
        decoder_floor = max(start, end - tail) if tail else None
        hit_step = functools.partial(
            _replay, runner, prompt, start, turn % 2, blocks, hit, decoder_floor
        )
        decoder_start = start if decoder_floor is None else decoder_floor
        out.append(Hit(hit_step(), end - start, end - decoder_start, hit_step))
    return out


def time_steps(refs: list[Hit], hits: dict[str, list[Hit | None]], repeats: int) -> None:
    """Median seconds of every turn's steps, run round-robin (full prefill, then each mode)
    `repeats` times, so that a shared machine's load falls on all of them alike."""
    for turn, ref in enumerate(refs):
        steps = [ref] + [h for h in (hits[m][turn] for m in MODES) if h is not None]
        samples: list[list[float]] = [[] for _ in steps]
        for _ in range(repeats):
            for i, h in enumerate(steps):
                samples[i].append(_seconds(h.step))
        for h, times in zip(steps, samples, strict=True):
            h.seconds = statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first", type=int, default=499, help="tokens of the first prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(_checkpoint(args.model, args.cache), progress=False)
    cfg = model.config
    prompts = conversation(args.turns, args.first, cfg.vocab_size)
    print(
        f"model {args.model} (window {cfg.sliding_window}, {cfg.num_hidden_layers} layers, "
        f"decoder from layer {cfg.ced_boundary}), torch {torch.__version__}, "
        f"{args.threads} threads; prompts {[len(p) for p in prompts]}"
    )
    refs = [full_prefill(model, p) for p in prompts]
    hits = {mode: run_mode(model, mode, prompts) for mode in MODES}
    load = os.getloadavg()[0]
    time_steps(refs[1:], {m: h[1:] for m, h in hits.items()}, args.repeats)
    print(f"1-minute load average before / after timing: {load:.1f} / {os.getloadavg()[0]:.1f}")
    print(
        f"{'turn':>4} {'S':>5} {'P':>5} {'mode':16} {'max|Δlogit|':>11} {'rel L2':>9} "
        f"{'argmax':>6} {'margin':>6} {'enc rows':>8} {'dec rows':>8} {'hit s':>7} "
        f"{'full s':>7} {'saved':>6}"
    )
    for turn in range(1, len(prompts)):
        ref = refs[turn]
        top2 = ref.logits.topk(2).values
        hit_at = len(prompts[turn - 1]) // BLOCK_TOKENS * BLOCK_TOKENS
        for mode in MODES:
            h = hits[mode][turn]
            assert h is not None
            diff = h.logits - ref.logits
            same = "same" if int(h.logits.argmax()) == int(ref.logits.argmax()) else "DIFF"
            print(
                f"{turn + 1:>4} {len(prompts[turn]):>5} {hit_at:>5} {mode:16} "
                f"{float(diff.abs().max()):>11.3g} "
                f"{float(diff.norm() / ref.logits.norm()):>9.3g} {same:>6} "
                f"{float(top2[0] - top2[1]):>6.3f} {h.encoder_rows:>8} {h.decoder_rows:>8} "
                f"{h.seconds:>7.3f} {ref.seconds:>7.3f} {1 - h.seconds / ref.seconds:>6.0%}"
            )


if __name__ == "__main__":
    main()
