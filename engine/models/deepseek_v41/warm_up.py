"""Run the step shapes a server meets once at start, so its first requests do not pay for them.

Triton compiles a kernel per specialisation (constexprs, integer arguments divisible by 16 or
equal to 1) and autotunes the grouped MXFP4 GEMM's prefill tiles and the indexer's tiles on
first use: on the H200 the first requests through a fresh server waited tens of seconds for
their first token (docs/performance.md, 2026-12-02). CUDA-graph capture at start compiles the
graphed segments' kernels for decode buckets only; the attention's middle (sparse attention,
the indexer, the KV row codecs) and every prefill shape still compiled under the first users.

Each warm-up step is a `forward_step` on scratch state (random token ids, zeroed KV), freed
afterwards; the runner's state, the KV pool and the prefix cache are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.models.deepseek_v41.state import BLOCK_TOKENS, StepBatch, sequential_batch


@dataclass(frozen=True)
class WarmUpStep:
    """`num_seqs` sequences of `tokens_per_seq` new tokens each, after `context` cached ones."""

    num_seqs: int
    tokens_per_seq: int
    context: int = 0


def serving_warm_up_steps(
    max_prefill_tokens: int, max_num_seqs: int, num_speculative_tokens: int
) -> tuple[WarmUpStep, ...]:
    """The steps that reach every launch shape of serving: a long prefill chunk (capped at
    4,096 tokens: longer chunks take the same tiles, and specialise alike as multiples of 16)
    and a short ragged one; decode at 1 sequence and at the largest decode batch up to 64
    (the sparse attention's and the grouped GEMM's decode tiles change at 16 and 256 tokens);
    with speculation, verify rows of 1 + drafts tokens."""
    long = min(4096, max_prefill_tokens)
    steps = [WarmUpStep(1, long), WarmUpStep(1, min(300, long) | 1)]
    steps += [WarmUpStep(1, 1, 300), WarmUpStep(min(64, max_num_seqs), 1, 300)]
    if num_speculative_tokens:
        verify_seqs = min(8, max_num_seqs)
        steps.append(WarmUpStep(verify_seqs, 1 + num_speculative_tokens, 300))
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
def warm_up(model, steps: Sequence[WarmUpStep]) -> None:
    """Run each of `steps` once through `model.forward_step` on its own scratch state.

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
        del state
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
        torch.cuda.empty_cache()
