"""Padded decode steps (`decode_batch.py`, what a step graph captures) against today's steps.

Two sequences are prefilled, then decoded token by token across compression-group and
128-token block boundaries, once through plain `StepBatch`es and once through a
`PaddedDecodeBatch` with padding rows and a wider block table, from identical states. The
logits and every real slot's and block's state must agree; the scratch slot and trash block
are filled with garbage first, so a real row that read them would diverge.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.models.deepseek_v41.decode_batch import DecodeBuffers, can_pad
from engine.models.deepseek_v41.moe import MoE
from engine.models.deepseek_v41.state import ModelState, sequential_batch
from tests.kernels.interpreted import run_interpreted

# Decode crosses block 0 → 1 (position 128) and ratio-2 groups; the interpreter's run is
# shorter (its prefill is slow) and crosses groups only.
PROMPT_LENS, DECODE_STEPS = (124, 61), 7
INTERPRETED_LENS, INTERPRETED_STEPS = (5, 2), 3
NUM_ROWS, BLOCKS_CAP = 4, 4  # two padding rows, unused table columns


def _fill_garbage(state: ModelState) -> None:
    generator = torch.Generator().manual_seed(1)

    def junk(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.uint8:
            return torch.randint(0, 256, t.shape, generator=generator, dtype=torch.uint8)
        if t.dtype == torch.long:
            return torch.randint(0, 1000, t.shape, generator=generator)
        return (torch.randn(t.shape, generator=generator) * 100).to(t.dtype)

    slot, block = state.scratch_slot, state.trash_block
    for ring in [*state.swa, *state.pending.values(), state.tokens, *state.draft_swa]:
        ring[slot] = junk(ring[slot])
    for pool in [*state.global_kv.values(), *state.index_keys.values()]:
        pool[block] = junk(pool[block])


def _real_parts(state: ModelState, num_slots: int, num_blocks: int) -> list[torch.Tensor]:
    parts = [ring[:num_slots] for ring in [*state.swa, *state.pending.values(), state.tokens]]
    return parts + [p[:num_blocks] for p in [*state.global_kv.values(), *state.index_keys.values()]]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _selection_mismatches(plain: dict, padded: dict) -> int:
    """Selections [T, k] of the plain step that the padded one does not hold as its first k
    columns in the same order (its real rows), followed by −1 only."""
    bad = 0
    for key, ours in padded.items():
        if key.endswith(".selection"):
            theirs = plain[key]
            width = theirs.shape[1]
            mine = ours[: theirs.shape[0]]
            bad += int((mine[:, :width] != theirs).any(-1).sum())
            bad += int((mine[:, width:] != -1).any(-1).sum())
    return bad


@torch.inference_mode()
def compare_padded_decode(
    model: Any, prompt_lens: tuple[int, int] = PROMPT_LENS, steps: int = DECODE_STEPS
) -> dict[str, float]:
    """Greedy decode of two prompts through plain and padded steps; the largest relative
    logits error, the largest relative error of any real state tensor (codes compared as
    the fraction of differing bytes) and whether any logit is non-finite."""
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,)).tolist() for n in prompt_lens]
    num_slots, num_blocks = 2, 4
    table = torch.tensor([[0, 1], [2, 3]])
    state = model.allocate_state(num_slots, num_blocks, reserve_scratch=True)
    logits = model.forward_step(sequential_batch(prompts, [0, 0], [0, 1], table), state).logits
    states = [state, copy.deepcopy(state)]  # one prefill (the interpreter's is slow), two copies
    ends = [prompt_lens[0] - 1, sum(prompt_lens) - 1]
    tokens = logits[ends].argmax(-1).tolist()
    _fill_garbage(states[1])
    buffers = DecodeBuffers(NUM_ROWS, BLOCKS_CAP, states[1], "cpu")
    worst_logits, finite, mismatches = 0.0, True, 0
    for step in range(steps):
        positions = [n + step for n in prompt_lens]
        batch = sequential_batch([[t] for t in tokens], positions, [0, 1], table)
        assert can_pad(batch)
        records: tuple[dict, dict] = ({}, {})
        reference = model.forward_step(batch, states[0], records[0]).logits
        buffers.fill(batch)
        padded = model.forward_step(buffers.batch(), states[1], records[1]).logits
        mismatches += _selection_mismatches(*records)
        finite &= bool(torch.isfinite(padded[:2]).all())
        worst_logits = max(worst_logits, _rel(padded[:2], reference))
        tokens = reference.argmax(-1).tolist()
    worst_state = 0.0
    pairs = zip(
        _real_parts(states[1], num_slots, num_blocks),
        _real_parts(states[0], num_slots, num_blocks),
        strict=True,
    )
    for ours, theirs in pairs:
        if ours.dtype in (torch.uint8, torch.long):
            worst_state = max(worst_state, float((ours != theirs).double().mean()))
        else:
            worst_state = max(worst_state, _rel(ours, theirs))
    return {
        "logits": worst_logits,
        "state": worst_state,
        "finite": float(finite),
        "selection_mismatches": mismatches,
    }


@pytest.mark.parametrize("fixture", ["tiny_model_exact_kv", "tiny_model"])
def test_padded_decode_matches_plain_decode(fixture: str, request: pytest.FixtureRequest) -> None:
    result = compare_padded_decode(request.getfixturevalue(fixture))
    assert result["finite"] == 1.0 and result["selection_mismatches"] == 0, result
    assert result["logits"] < 1e-5, result
    assert result["state"] < 1e-5, result


_INTERPRETED = """
import json, torch
from engine.models import Numerics, load_model
from tests.models.test_padded_decode import *
model = load_model({checkpoint!r}, dtype=torch.{dtype}, numerics=Numerics(kv_quantize={quantize!r}))
print(json.dumps(compare_padded_decode(model, INTERPRETED_LENS, INTERPRETED_STEPS)))
"""


@pytest.mark.slow  # ~1 min of interpreted kernels
@pytest.mark.parametrize("quantize, dtype", [(True, "float32"), (True, "bfloat16")])
def test_padded_decode_on_the_kernel_paths(tiny_checkpoint: Path, quantize: bool, dtype) -> None:
    # bf16: also the tensor-core branches of the fp32 products (the split and sum kernels, the
    # packed compressors), given the GPU's fp32-output bf16 GEMM
    code = _INTERPRETED.format(checkpoint=str(tiny_checkpoint), quantize=quantize, dtype=dtype)
    result = run_interpreted(code, tensor_core_gemms=dtype == "bfloat16")
    assert result["finite"] == 1.0 and result["selection_mismatches"] == 0, result
    assert result["logits"] < 1e-4, result  # measured 7e-6
    assert result["state"] < 1e-4, result


def test_padding_rows_need_a_scratch_slot(tiny_model) -> None:
    state = tiny_model.allocate_state(2, 2)
    with pytest.raises(ValueError, match="scratch"):
        DecodeBuffers(2, 2, state, "cpu")


class _OpTrace(TorchDispatchMode):
    """Every aten op with the shapes of its tensor inputs and outputs, except while paused."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            leaves = tree_leaves((args, kwargs, out))
            shapes = tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))
            self.ops.append((str(func), shapes))
        return out


@torch.inference_mode()
def _decode_ops(model: Any, positions: tuple[int, int], padded: bool) -> list[tuple[str, tuple]]:
    """The op trace of one decode step of two sequences at `positions` (after their prefill).
    The routed experts are left out: on the CPU they take the per-expert reference path,
    whose shapes follow the routing (CUDA runs the grouped kernel, shape-stable)."""
    state = model.allocate_state(2, 4, reserve_scratch=True)
    table = torch.tensor([[0, 1], [2, 3]])
    prefill = sequential_batch([[5] * positions[0], [7] * positions[1]], [0, 0], [0, 1], table)
    model.forward_step(prefill, state)
    batch = sequential_batch([[3], [4]], list(positions), [0, 1], table)
    if padded:
        buffers = DecodeBuffers(NUM_ROWS, BLOCKS_CAP, state, "cpu")
        buffers.fill(batch)
        batch = buffers.batch()
    trace, hooks = _OpTrace(), []

    def pause(*_: Any) -> None:
        trace.paused += 1

    def resume(*_: Any) -> None:
        trace.paused -= 1

    for module in model.modules():
        if isinstance(module, MoE):
            hooks += [module.register_forward_pre_hook(pause), module.register_forward_hook(resume)]
    try:
        with trace:
            model.forward_step(batch, state)
    finally:
        for hook in hooks:
            hook.remove()
    return trace.ops


def test_padded_decode_steps_repeat_one_op_sequence(tiny_model) -> None:
    # What one captured graph replays: every padded step of a shape runs the same ops on the
    # same shapes, whatever its contexts and position parities; plain steps do not (the
    # indexer's key count grows, ratio-2 compressors pool only odd positions).
    early, late = (20, 9), (21, 130)
    assert _decode_ops(tiny_model, early, True) == _decode_ops(tiny_model, late, True)
    assert _decode_ops(tiny_model, early, False) != _decode_ops(tiny_model, late, False)


_STEP_SHAPES_ONE_VARIANT = """
import json
import torch
from engine.models import load_model
from engine.models.deepseek_v41.decode_batch import DecodeBuffers
from engine.models.deepseek_v41.state import sequential_batch
from tests.kernels.specializations import describe_new_keys, record_launch_keys
model = load_model({checkpoint!r}, dtype=torch.{dtype})
state = model.allocate_state(8, 16, reserve_scratch=True)

def decode_keys(num_rows, blocks_cap, prompt_lens, steps):
    # Launch keys of padded decode steps only (the prefill before them is not recorded).
    n = len(prompt_lens)
    table = torch.arange(2 * n).view(n, 2)
    prompts = [[5 + i] * length for i, length in enumerate(prompt_lens)]
    with torch.inference_mode():
        model.forward_step(sequential_batch(prompts, [0] * n, list(range(n)), table), state)
        buffers = DecodeBuffers(num_rows, blocks_cap, state, "cpu")
        keys = set()
        for step in range(steps):
            positions = [length + step for length in prompt_lens]
            batch = sequential_batch([[3]] * n, positions, list(range(n)), table)
            buffers.fill(batch)
            with record_launch_keys() as launched:
                model.forward_step(buffers.batch(), state)
            keys |= launched
    return keys

first = decode_keys(4, 2, (5, 2), 2)
other = decode_keys(8, 3, (9, 3, 17), 2) | decode_keys(2, 6, (33,), 1) | decode_keys(1, 2, (7,), 1)
print(json.dumps(describe_new_keys(other - first, first)))
"""


@pytest.mark.slow  # ~1 min of interpreted kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_steps_of_other_shapes_launch_no_new_kernel_variant(
    tiny_checkpoint: Path, dtype: str
) -> None:
    # A step graph captures each (rows, block columns) shape on first use, after one eager run:
    # if a new shape needed a new Triton variant, that run would compile while serving. The
    # interpreter records each launch's specialisation key (`tests/kernels/specializations`).
    # bf16: with the tensor-core branches of the fp32 products (split and sum kernels).
    code = _STEP_SHAPES_ONE_VARIANT.format(checkpoint=str(tiny_checkpoint), dtype=dtype)
    new = run_interpreted(code, tensor_core_gemms=dtype == "bfloat16")
    assert new == [], new
