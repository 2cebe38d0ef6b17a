"""The fused launches against the unfused calls they replace, on the whole `tiny` model in
Triton's interpreter (the kernel paths): logits and state bit for bit.

`unfused()` patches the fusions back to separate calls: the queries' RoPE as its own launch
before `sparse_mqa` (instead of its `rotate_q`); the window row's norm + RoPE launch, then the
MXFP8 encoding launch, then the ring's index put (instead of `KVCodec.normed_rotated_encode`'s
one launch that also stores a decode step's rows into the ring); `mhc_post` then
`mhc_combine_norm` (instead of `mhc_post_combine_norm`); `moe_combine` then `mhc_post`
(instead of the FFN update adding the MoE's shared output and routed slots itself); the mHC
triplet's two launches (instead of one); torch's top-k and the −1 masking (instead of
`kernels.index_topk`: the same selection where no scores tie, as here).
`fusion_outputs` runs a prefill of two sequences, a chunk beside a decode row, plain decode
steps, padded decode steps (what a step graph captures; not in batch-invariant mode, which has
none) and a prefix-cache replay (window floor and reuse end), and returns every step's logits
and the whole state after each part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.models.deepseek_v41.decode_batch import DecodeBuffers
from engine.models.deepseek_v41.state import (
    ModelState,
    StepBatch,
    sequential_batch,
    write_token_history,
)
from tests.kernels.interpreted import run_interpreted


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """The fused launches replaced by the calls they fuse, for the duration."""
    import kernels.index_topk as topk
    import kernels.mhc_post as post
    import kernels.mhc_triplet as triplet
    import kernels.sparse_mqa as mqa
    from engine.models.deepseek_v41.kv_formats import KVCodec
    from engine.models.deepseek_v41.primitives import rms_norm_rope
    from kernels.mhc_combine import mhc_combine_norm
    from kernels.moe_combine import moe_combine
    from kernels.rope import apply_rope

    fused = (mqa.sparse_mqa, KVCodec.normed_rotated_encode, post.mhc_post_combine_norm)
    fused += (triplet.mhc_triplet, topk.index_topk, post.mhc_post)

    def attention(q, seq_of_token, positions, *args, rotate_q=None, **kwargs):
        if rotate_q is not None:
            q = apply_rope(q, positions, rotate_q)
        return fused[0](q, seq_of_token, positions, *args, **kwargs)

    def encode(codec, x, weight, eps, positions, freqs, copy_to=None):
        encoded = codec.encode(rms_norm_rope(x, weight, eps, positions, freqs)[0])
        if copy_to is not None:
            rows, index = copy_to
            rows[index] = encoded
        return encoded

    def update_and_norm(residual, post_w, comb, y, weights, norm_weight, eps, kernel_order=False):
        assert not kernel_order  # the decode tiles do not run in the interpreter
        updated = post.mhc_post(residual, post_w, comb, y)
        return updated, mhc_combine_norm(updated, weights, norm_weight, eps), None

    def combine_then_update(residual, post_w, comb, y, slots=None):
        return fused[5](residual, post_w, comb, y if slots is None else moe_combine(y, slots))

    def two_launches(*args, **kwargs):
        return fused[3](*args, **kwargs, one_launch=False)

    mqa.sparse_mqa, KVCodec.normed_rotated_encode = attention, encode
    post.mhc_post_combine_norm, triplet.mhc_triplet = update_and_norm, two_launches
    topk.index_topk, post.mhc_post = topk.index_topk_reference, combine_then_update
    try:
        yield
    finally:
        mqa.sparse_mqa, KVCodec.normed_rotated_encode, post.mhc_post_combine_norm = fused[:3]
        triplet.mhc_triplet, topk.index_topk, post.mhc_post = fused[3:]


def _state_tensors(state: ModelState, label: str) -> dict[str, torch.Tensor]:
    parts = {f"{label} swa {i}": t for i, t in enumerate(state.swa)}
    for name in ("global_kv", "index_keys", "pending"):
        parts |= {f"{label} {name} {k}": t for k, t in getattr(state, name).items()}
    return {key: t.clone() for key, t in (parts | {f"{label} tokens": state.tokens}).items()}


@torch.inference_mode()
def fusion_outputs(model: Any) -> dict[str, torch.Tensor]:
    """Logits of every step and the state after each part of the run (module docstring)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in (21, 6)]
    table = torch.tensor([[0, 1], [2, 3], [4, 5]])
    state = model.allocate_state(3, 8, reserve_scratch=True)
    out: dict[str, torch.Tensor] = {}
    logits = model.forward_step(sequential_batch(prompts, [0, 0], [0, 1], table[:2]), state)
    out["prefill"] = logits.logits
    tokens = logits.logits[[20, 26]].argmax(-1).tolist()
    more = torch.randint(1, vocab, (4,), generator=generator).tolist()
    chunk = sequential_batch([[tokens[0], *more], [tokens[1]]], [21, 6], [0, 1], table[:2])
    logits = model.forward_step(chunk, state).logits
    out["chunk beside a decode row"] = logits
    tokens, positions = logits[[4, 5]].argmax(-1).tolist(), [26, 7]
    out |= _state_tensors(state, "after prefill")
    for step in range(2):
        batch = sequential_batch([[t] for t in tokens], positions, [0, 1], table[:2])
        logits = model.forward_step(batch, state).logits
        out[f"decode {step}"] = logits
        tokens, positions = logits.argmax(-1).tolist(), [p + 1 for p in positions]
    out |= _state_tensors(state, "after decode")
    if not model.numerics.batch_invariant:  # step graphs refuse that mode
        buffers = DecodeBuffers(4, 3, state, "cpu")
        for step in range(2):
            buffers.fill(sequential_batch([[t] for t in tokens], positions, [0, 1], table[:2]))
            logits = model.forward_step(buffers.batch(), state).logits
            out[f"padded decode {step}"] = logits
            tokens, positions = logits[:2].argmax(-1).tolist(), [p + 1 for p in positions]
        out |= _state_tensors(state, "after padded decode")
    # A prefix-cache hit: sequence 2 finds the first 16 positions of sequence 0 in a cached
    # block (block 4, a copy of sequence 0's block 0) and recomputes from position 10, its
    # window floor, to 18.
    for pool in [*state.global_kv.values(), *state.index_keys.values()]:
        pool[4] = pool[0]
    history = prompts[0][:16] + torch.randint(1, vocab, (3,), generator=generator).tolist()
    write_token_history(state, 2, 7, history[7:10])
    replay = StepBatch(
        token_ids=torch.tensor(history[10:]),
        starts=[0, 9],
        start_positions=[10],
        slots=torch.tensor([2]),
        block_tables=table[2:],
        window_floors=[10],
        reuse_ends=[16],
    )
    out["replay"] = model.forward_step(replay, state).logits
    return out | _state_tensors(state, "after replay")


def fusion_mismatches(model: Any) -> list[str]:
    """The outputs of `fusion_outputs` that differ in any bit with `unfused()`."""
    fused = fusion_outputs(model)
    with unfused():
        separate = fusion_outputs(model)
    assert fused.keys() == separate.keys()
    return [key for key in fused if not torch.equal(fused[key], separate[key])]


_INTERPRETED = """
import json
import torch
from engine.models import Numerics, load_model
from tests.models.test_attention_fusions import fusion_mismatches
numerics = Numerics(batch_invariant={invariant!r})
model = load_model({checkpoint!r}, dtype=torch.bfloat16, numerics=numerics)
print(json.dumps(fusion_mismatches(model)))
"""


@pytest.mark.slow  # minutes of interpreted kernels
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_fused_attention_launches_change_no_bit_of_tiny(
    tiny_checkpoint: Path, invariant: bool
) -> None:
    code = _INTERPRETED.format(checkpoint=str(tiny_checkpoint), invariant=invariant)
    assert run_interpreted(code, timeout_s=1800) == []
