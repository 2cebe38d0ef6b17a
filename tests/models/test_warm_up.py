"""The start-up warm-up (`engine/models/deepseek_v41/warm_up.py`): every serving launch shape
once, on scratch state that leaves the model's answers unchanged, reaching every row of every
launch table, so that a warmed engine compiles nothing while it serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.deepseek_v41.config import preset_config
from engine.models.deepseek_v41.moe import _block_m
from engine.models.deepseek_v41.warm_up import serving_warm_up_steps, warm_up
from kernels import expert_alignment, fp8_block_gemm, mhc_triplet, sparse_mqa
from kernels.index_scores import block_t_for
from tests.kernels.interpreted import run_interpreted

SERVER = {"max_prefill_tokens": 32768, "max_num_seqs": 256}


def test_warm_up_leaves_the_models_answers_unchanged(tiny_model) -> None:
    prompts = [[0, *range(20, 60)], [0, 5, 9]]
    before = tiny_model.logits(prompts)
    steps = serving_warm_up_steps(max_prefill_tokens=512, max_num_seqs=4, num_speculative_tokens=5)
    warm_up(tiny_model, steps, drafts=True)
    assert torch.equal(tiny_model.logits(prompts), before)


def _token_counts(steps, *, decode: bool | None = None) -> set[int]:
    """The steps' token counts (decode=True: one-token steps only, the ring's; False: the
    others, whose window comes from bf16 rows)."""
    return {
        s.num_seqs * s.tokens_per_seq
        for s in steps
        if decode is None or (s.tokens_per_seq == 1) == decode
    }


@pytest.mark.parametrize("drafts", [0, 5])
def test_the_serving_steps_reach_every_row_of_the_launch_tables(drafts: int) -> None:
    # Each launch-shape table (a pure function of shapes) must be compiled at start: some
    # warm-up step falls in every row a server with these limits can reach.
    steps = serving_warm_up_steps(**SERVER, num_speculative_tokens=drafts)
    longest = min(4096, SERVER["max_prefill_tokens"])
    reachable = range(1, longest + 1)
    counts = _token_counts(steps)
    # sparse attention: by token count, once with the window in the ring (decode), once from
    # bf16 rows (longer rows, mixed and verify steps)
    for decode, top in ((True, SERVER["max_num_seqs"]), (False, longest)):
        seen = {sparse_mqa.choose_tiles(n) for n in _token_counts(steps, decode=decode)}
        assert seen == {sparse_mqa.choose_tiles(n) for n in range(1, top + 1)}, decode
    assert {mhc_triplet.config_for(n) for n in counts} == set(
        map(mhc_triplet.config_for, reachable)
    )

    def fp8_class(m: int) -> tuple:  # the constexprs and the partials' dtype
        config = fp8_block_gemm.default_config(m, 4096, 4096)
        return (
            config.block_m,
            config.block_n,
            config.num_warps,
            config.num_stages,
            config.split_k > 1,
        )

    assert {fp8_class(n) for n in counts} == set(map(fp8_class, reachable))
    default = preset_config("default")
    experts, top_k = default.n_routed_experts, default.num_experts_per_tok
    assert {_block_m(n * top_k, experts) for n in counts} == {
        _block_m(n * top_k, experts) for n in reachable
    }

    def aligned_by_kernel(ns) -> set[int]:  # the alignment kernel's variants: one per block size
        return {_block_m(n * top_k, experts) for n in ns if n * top_k <= expert_alignment.MAX_PAIRS}

    assert aligned_by_kernel(counts) == aligned_by_kernel(reachable)
    heads = default.index_n_heads
    lengths = {s.tokens_per_seq for s in steps}
    assert {block_t_for(heads, n) for n in lengths} == {block_t_for(heads, n) for n in reachable}
    assert max(counts) == 4096  # a long chunk, capped: longer chunks take the same rows
    assert any(s.tokens_per_seq % 16 and s.tokens_per_seq > 16 for s in steps)  # a ragged one


_ONE_VARIANT = """
import json, torch
from engine.models import load_model
from engine.models.deepseek_v41.warm_up import WarmUpStep, warm_up
from tests.kernels.specializations import describe_new_keys, record_launch_keys
model = load_model({checkpoint!r}, dtype=torch.{dtype})
with record_launch_keys() as warm:
    warm_up(model, [WarmUpStep(1, 9), WarmUpStep(1, 1, 40), WarmUpStep(2, 1, 40)])
with record_launch_keys() as serving:
    warm_up(model, [WarmUpStep(3, 1, 57), WarmUpStep(1, 16, 16), WarmUpStep(1, 1, 130)])
print(json.dumps(describe_new_keys(serving - warm, warm)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_of_other_sizes_launch_no_new_kernel_variant(tiny_checkpoint: Path, dtype) -> None:
    # In Triton's interpreter every launch's specialisation key (what a GPU compiles per
    # variant: constexprs, integer values 1 and divisibility by 16 where not
    # `do_not_specialize`, pointer alignment, launch options) is recorded: steps with other
    # token, sequence, context (the indexer's num_j) and block-table sizes, within the same
    # table rows, must launch only keys the first steps launched.
    # bf16: the fp32 products of bf16 weights take their tensor-core branch (split and sum
    # kernels) given the GPU's fp32-output bf16 GEMM
    code = _ONE_VARIANT.format(checkpoint=str(tiny_checkpoint), dtype=dtype)
    new = run_interpreted(code, tensor_core_gemms=dtype == "bfloat16")
    assert new == [], new
