"""Run the step shapes a server meets once at start, so that serving compiles nothing.

Triton compiles a kernel per specialisation (constexprs, integer arguments divisible by 16 or
equal to 1, 16-byte aligned pointers, launch options). The rule that keeps serving free of
compiles (docs/architecture.md): every kernel on the serving path takes its launch shape from a
table that is a pure function of shapes (`sparse_mqa.TILES` by token count, `mhc_triplet.CONFIGS`
by token count, `index_scores.block_t_for` by new tokens per sequence, the grouped MXFP4 GEMM's
`decode_tiles` / `prefill_tiles` by block size, `fp8_block_gemm.default_config` and
`fp8_weight_gemm.choose_tiles` by rows), marks
the integers that change from step to step `do_not_specialize`, and is never autotuned; the
warm-up then reaches every row of every table. On the H200 a server whose warm-up missed rows
spent 18 % of its engine thread compiling and 14 % autotuning under 256 streams (ITL p99 2.4 s;
docs/performance.md).

The steps: decode (window from the ring) and multi-token steps (window from bf16 rows) at
every power of two of sequences / tokens up to the limits (each table's bounds are powers of
two, so every row's range holds one), a ragged chunk, verify rows and drafts with speculation,
and the sampler's top-p search once. Each step is a `forward_step` on scratch state (random
token ids, zeroed KV), freed afterwards; the runner's state, the KV pool and the prefix cache
are never touched. CUDA-graph capture (before this) compiles the graphed segments' kernels for
its buckets; this covers the attention's middle and every eager shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.models.deepseek_v41.state import BLOCK_TOKENS, StepBatch, sequential_batch
from kernels import runs_kernels
from kernels.nucleus_cutoff import nucleus_cutoffs


@dataclass(frozen=True)
class WarmUpStep:
    """`num_seqs` sequences of `tokens_per_seq` new tokens each, after `context` cached ones."""

    num_seqs: int
    tokens_per_seq: int
    context: int = 0


LONG_CHUNK_CAP = 4096  # longer chunks take the same rows of every table (their largest)
RAGGED_CHUNK = 301  # a chunk length divisible by nothing (integer specialisation)
MAX_VERIFY_SEQS = 64


def powers_of_two(top: int) -> list[int]:
    """1, 2, 4, ... below `top`, then `top` itself (every power-of-two bound up to top lies in
    the list, and so does top's own row)."""
    values = [1 << i for i in range(max(top, 1).bit_length()) if 1 << i < top]
    return values + [top]


def serving_warm_up_steps(
    max_prefill_tokens: int, max_num_seqs: int, num_speculative_tokens: int
) -> tuple[WarmUpStep, ...]:
    """The steps that reach every launch shape of serving (module docstring): decode at every
    power of two of sequences up to `max_num_seqs`; one-sequence chunks of every power of two
    of tokens from 2 up to the long chunk (capped at `LONG_CHUNK_CAP`) and a ragged one; with
    speculation, verify rows of 1 + drafts tokens at powers of two of sequences up to
    `MAX_VERIFY_SEQS`."""
    long = min(LONG_CHUNK_CAP, max_prefill_tokens)
    steps = [WarmUpStep(n, 1, 300) for n in powers_of_two(max_num_seqs)]
    steps += [WarmUpStep(1, n) for n in powers_of_two(long) if n > 1]
    steps.append(WarmUpStep(1, min(RAGGED_CHUNK, long) | 1))
    if num_speculative_tokens:
        verify = powers_of_two(min(MAX_VERIFY_SEQS, max_num_seqs))
        steps += [WarmUpStep(n, 1 + num_speculative_tokens, 300) for n in verify]
    return tuple(steps)


def synthetic_batch(step: WarmUpStep, vocab_size: int, device: torch.device) -> StepBatch:
    """The step's batch of random token ids (also the benchmarks' `gpu_rank` and
    `kernel_census`): sequence i in slot i, its blocks laid out one after the other, the
    logits of each sequence's last row only (as serving asks for them)."""
    n, per_seq = step.num_seqs, step.tokens_per_seq
    blocks = -(-(step.context + per_seq) // BLOCK_TOKENS)
    generator = torch.Generator().manual_seed(n * 7919 + per_seq)
    token_ids = torch.randint(3, min(vocab_size, 100_000), (n, per_seq), generator=generator)
    return sequential_batch(
        token_ids.tolist(),
        [step.context] * n,
        list(range(n)),
        torch.arange(n * blocks).view(n, blocks),
        device,
        logits_indices=torch.arange(1, n + 1) * per_seq - 1,
    )


@torch.inference_mode()
def warm_up(model, steps: Sequence[WarmUpStep], *, drafts: bool = False) -> None:
    """Run each of `steps` once through `model.forward_step` on its own scratch state; with
    `drafts`, also the DSpark drafter's block at each step's sequence count (one token per
    sequence steps only: drafts follow decode and verify steps); then the sampler's top-p
    search once (the sampler's only kernel).

    Raises:
        ValueError: with expert parallelism (a lone rank's forward would wait in the MoE
            collectives for ranks that are not stepping).
    """
    if model.expert_parallel is not None:
        raise ValueError("warm_up runs one rank alone: not with expert parallelism")
    for step in steps:
        batch = synthetic_batch(step, model.config.vocab_size, model.device)
        state = model.allocate_state(step.num_seqs, batch.block_tables.numel())
        model.forward_step(batch, state)
        if drafts and step.tokens_per_seq == 1:
            _draft(model, step, state)
        del state
    _sample(model.config.vocab_size, model.device)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
        torch.cuda.empty_cache()


def _draft(model, step: WarmUpStep, state) -> None:
    """One drafter block for the step's sequences, after their context."""
    n = step.num_seqs
    anchors = torch.randint(3, min(model.config.vocab_size, 100_000), (n,), device=model.device)
    positions = torch.full((n,), step.context + 1, device=model.device)
    model.draft(anchors, positions, torch.arange(n, device=model.device), state)


def _sample(vocab_size: int, device: torch.device) -> None:
    """The sampler's top-p search (`kernels.nucleus_cutoff`) on two rows of logits."""
    if not runs_kernels(torch.empty(0, device=device)):
        return
    logits = torch.randn(2, vocab_size, device=device)
    nucleus_cutoffs(logits, torch.zeros(2, dtype=torch.int64, device=device),
                    torch.full((2,), 0.9, device=device))  # fmt: skip
