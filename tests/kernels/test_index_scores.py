"""The indexer's scores from the paged FP4 key pool against the torch reference.

Every product iq[h, d] · key[j, d] is exact (both are FP4 values times powers of two), so the
kernel and the float64 reference differ only by fp32 rounding of the sums. First order, a sum
of n terms in any order rounds within (n − 1)·u·Σ|term| (u = 2^-24); relu does not grow an
error; so a score lies within (D + H + 1)·u·A of the exact value, A = Σ_h |hw_h| Σ_d |q_hd k_jd|
(D products, one weight product, H heads, the reference's own rounding). The bound checked is
twice that: tensor-core fp32 accumulation truncates where IEEE rounds (up to 2u an add). A
relative norm would hide a single wrong position; this bound is per score and scale-aware
(a head sum may cancel), and a wrong key, head or weight breaks it by orders of magnitude.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.deepseek_v41.kv_formats import index_fp4_quantize, index_fp4_round_trip
from kernels.index_scores import CANDIDATES, IndexTiles, index_scores, index_scores_reference
from tests.kernels.interpreted import compile_for_hopper, run_interpreted

# (lengths per sequence, start positions, heads, head dim, ratio): decode batches (T = 1),
# ragged prefill chunks with padded rows, few heads (several tokens per dot), heads that are
# not a power of two, the released 64 × 128, ratios 1, 2 and 4.
CASES = [
    ((1, 1, 1), (5, 200, 63), 16, 32, 2),
    ((7, 3), (0, 130), 4, 64, 1),
    ((2, 5, 1), (300, 17, 0), 12, 32, 2),
    ((2, 1), (260, 40), 64, 128, 2),
    ((3, 1), (700, 301), 8, 32, 4),
]
GPU_CASES = [
    ((1,) * 16, (4095,) * 16, 64, 128, 2),  # decode, J = 2048
    ((1,) * 64, tuple(4095 - 37 * i for i in range(64)), 64, 128, 2),  # ragged decode
    ((1,) * 7, (100, 4095, 9, 2047, 0, 130, 1), 32, 128, 2),
    ((512,), (3584,), 64, 128, 2),  # a prefill chunk at J = 2048
    ((300, 64, 1), (0, 1000, 3000), 64, 128, 1),
    ((33, 2), (5, 600), 16, 32, 2),
]
_U = 2.0**-24


def _inputs(case, device: str = "cpu"):
    """(iq, hw, pool, block_tables, ratio, pad_index, positions, num_j) for `index_scores`."""
    lengths, starts, heads, dim, ratio = case
    generator = torch.Generator().manual_seed(sum(lengths) + sum(starts) + heads + dim)
    num_tokens, t_max = sum(lengths), max(lengths)
    ends = [s + n - 1 for s, n in zip(starts, lengths, strict=True)]
    num_j = max((e + 1) // ratio for e in ends)
    per_block = 128 // ratio
    max_blocks = -(-max(ends) // 128) + 1
    num_blocks = len(lengths) * max_blocks + 3
    keys = torch.randn(num_blocks, per_block, dim, generator=generator)
    keys = keys * torch.exp2(torch.randint(-3, 4, (num_blocks, per_block, 1), generator=generator))
    pool = index_fp4_quantize(keys)
    tables = torch.full((len(lengths), max_blocks), -1, dtype=torch.long)
    order = torch.randperm(num_blocks, generator=generator)
    for b, end in enumerate(ends):  # each sequence's own blocks; −1 past its end
        own = end // 128 + 1
        tables[b, :own] = order[b * max_blocks : b * max_blocks + own]
    iq = index_fp4_round_trip(torch.randn(num_tokens, heads, dim, generator=generator))
    hw = torch.randn(num_tokens, heads, generator=generator) * (dim**-0.5 * heads**-0.5)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    first = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    local = torch.arange(t_max)
    pad_index = torch.where(
        local[None, :] < torch.tensor(lengths)[:, None], first[:, None] + local, -1
    )
    tensors = (iq, hw, pool, tables)
    return (
        *(t.to(device) for t in tensors),
        ratio,
        pad_index.to(device),
        positions.to(device),
        num_j,
    )


def _error_in_bounds(args, tiles: IndexTiles | None = None) -> tuple[float, bool]:
    """(max |kernel − reference| / bound over finite scores, whether the −inf sets agree)."""
    iq, hw, pool, tables, ratio, pad_index, positions, num_j = args
    ours = index_scores(*args, tiles=tiles)
    reference = index_scores_reference(*args)
    # Σ_h |hw| Σ_d |q k|: the reference on magnitudes (e2m1 codes keep their magnitudes when
    # the sign bit is cleared; the scale bytes stay).
    magnitudes = pool.clone()
    half = iq.shape[-1] // 2
    magnitudes[..., :half] &= 0x77
    terms = index_scores_reference(
        iq.abs(), hw.abs(), magnitudes, tables, ratio, pad_index, positions, num_j
    )
    same_inf = bool(torch.equal(torch.isinf(ours), torch.isinf(reference)))
    finite = torch.isfinite(reference)
    bound = 2 * (iq.shape[-1] + iq.shape[1] + 1) * _U * terms[finite].double()
    error = (ours[finite].double() - reference[finite].double()).abs()
    ratio_to_bound = float((error / bound.clamp(min=1e-300)).max()) if error.numel() else 0.0
    return ratio_to_bound, same_inf


_INTERPRETED = """
import json
from tests.kernels.test_index_scores import CASES, _error_in_bounds, _inputs
print(json.dumps([_error_in_bounds(_inputs(case)) for case in CASES]))
"""


def test_index_scores_match_the_reference_in_the_interpreter() -> None:
    results = run_interpreted(_INTERPRETED)
    assert len(results) == len(CASES)
    for case, (ratio_to_bound, same_inf) in zip(CASES, results, strict=True):
        assert same_inf, case
        assert ratio_to_bound <= 1.0, (case, ratio_to_bound)


# Three key tiles per program: programs whose last tiles lie past the visible positions and
# past num_j, one tile per program, and whether the two score the same. Then 64-key tiles: at
# ratio 4 (32 positions per pool block) a tile spans two blocks of the table.
_INTERPRETED_J_TILES = """
import json, torch
from kernels.index_scores import IndexTiles, index_scores
from tests.kernels.test_index_scores import CASES, _error_in_bounds, _inputs
results = []
for tiles in (IndexTiles(16, 4, j_tiles=3), IndexTiles(64, 4)):
    for case in CASES:
        args = _inputs(case)
        same = torch.equal(index_scores(*args, tiles=tiles), index_scores(*args))
        results.append([*_error_in_bounds(args, tiles), same])
print(json.dumps(results))
"""


def test_other_key_tiles_score_as_the_default_in_the_interpreter() -> None:
    results = run_interpreted(_INTERPRETED_J_TILES)
    assert len(results) == 2 * len(CASES)
    for case, (ratio_to_bound, same_inf, same) in zip(2 * CASES, results, strict=True):
        assert same_inf and same and ratio_to_bound <= 1.0, case


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", CANDIDATES, ids=str)
@pytest.mark.parametrize("case", [CASES[3], GPU_CASES[0], GPU_CASES[3], GPU_CASES[4]], ids=str)
def test_every_candidate_matches_the_reference_on_cuda(case, tiles: IndexTiles) -> None:
    ratio_to_bound, same_inf = _error_in_bounds(_inputs(case, "cuda"), tiles)
    assert same_inf and ratio_to_bound <= 1.0, ratio_to_bound


def test_index_scores_rejects_a_head_dim_it_cannot_tile() -> None:
    iq, hw, pool, tables, ratio, pad_index, positions, num_j = _inputs(CASES[0])
    with pytest.raises(ValueError, match="power of two"):
        index_scores(iq[..., :24], hw, pool, tables, ratio, pad_index, positions, num_j)


def test_the_released_shape_compiles_to_tensor_core_dots() -> None:
    """Compiled for sm90 (what the interpreter cannot show): 64 heads × 128 in one wgmma tile,
    no register spills."""
    import triton.language as tl

    from kernels.index_scores import _index_scores_kernel

    kernel = _index_scores_kernel
    pointers = {"q": "fp32", "w": "fp32", "pool": "u8", "table": "i64", "pad": "i64"}
    types = {f"{name}_ptr": f"*{dtype}" for name, dtype in pointers.items()}
    types |= {"position_ptr": "*i64", "out_ptr": "*fp32"}
    types |= {n: "i32" for n in kernel.arg_names if n.startswith(("num_", "max_", "stride_"))}
    constexprs = {"RATIO": 2, "D": 128, "BLOCK_H": 64, "BLOCK_T": 1, "BLOCK_J": 128}
    constexprs |= {"J_TILES": 1, "NUM_STAGES": 1}
    constexprs["DOT_DTYPE"] = tl.bfloat16
    options = {"num_warps": 8, "num_stages": 1}
    ptx = compile_for_hopper(kernel, types, constexprs, {"q_ptr", "pool_ptr"}, options)
    assert "wgmma.mma_async" in ptx and ".bf16" in ptx
    assert ".local" not in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + GPU_CASES)
def test_index_scores_on_cuda(case) -> None:
    ratio_to_bound, same_inf = _error_in_bounds(_inputs(case, "cuda"))
    assert same_inf
    assert ratio_to_bound <= 1.0, ratio_to_bound


# Whole prompts on the tiny model's kernel paths (FP4 index rows): more visible positions than
# index_topk (8) at both ratios, a candidate source and consumers, ragged lengths. One run in the
# interpreter: each index layer selects twice on the same inputs, first with the indexer's torch
# scores (gather, decode, bmm; recorded, then undone), then with the kernel's, which the run goes
# on with. While every selection agrees this is the run with torch scores throughout; the first
# layer where one differs fails the test either way.
_SELECTIONS = """
import json, torch
from engine.models import load_model
from engine.models.deepseek_v41.attention import Attention
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (40, 23, 5)]
model = load_model({checkpoint!r})
select, with_torch_scores = Attention._select, {{}}

def select_both_ways(self, x, qa, ctx):
    candidates, record = ctx.candidates, ctx.record
    ctx.record, self._scores_in_kernel = with_torch_scores, lambda iq, ctx: False
    select(self, x, qa, ctx)
    del self._scores_in_kernel
    ctx.candidates, ctx.record = candidates, record
    select(self, x, qa, ctx)

Attention._select = select_both_ways
with_kernel_scores = {{}}
model.logits(prompts, record=with_kernel_scores)
kept = ("selection", "candidates")
runs = [with_kernel_scores, with_torch_scores]
print(json.dumps([{{k: v.tolist() for k, v in r.items() if k.endswith(kept)}} for r in runs]))
"""


@pytest.mark.slow  # a tiny-model run in the interpreter (~40 s on 2 cores)
def test_the_model_selects_the_same_positions_with_the_kernel(tiny_checkpoint: Path) -> None:
    """Every index layer's top-k selection (and the candidate mask) of a tiny-model run on its
    kernel paths is the same set with the kernel's scores as with the torch path's: the scores
    differ by fp32 summation order only, and no near tie falls across the k-th place here."""
    kernel, torch_path = run_interpreted(_SELECTIONS.format(checkpoint=str(tiny_checkpoint)))
    assert kernel.keys() == torch_path.keys() and len(kernel) >= 4
    for name, selection in kernel.items():
        ours, theirs = torch.tensor(selection), torch.tensor(torch_path[name])
        if name.endswith("selection"):
            assert (ours >= 0).sum() > 0, name
            ours, theirs = ours.sort(-1).values, theirs.sort(-1).values
        assert torch.equal(ours, theirs), name
