"""The top-k / top-p cut-off search against the rule in float64 and the sampler's sorted rule."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.nucleus_cutoff import (
    MASS_TOLERANCE,
    boundary_gaps,
    nucleus_cutoffs,
    nucleus_cutoffs_reference,
)
from tests.kernels.interpreted import run_interpreted

VOCAB = 129_280


def rows_of_every_kind(
    vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, top_k, top_p) of peaked, medium and flat rows at several top_p, ties, −inf
    entries (a grammar mask, banned tokens, one token left), a logit bias, top_k combined
    (inside a tie, above the finite count, wider than the candidates), tiny and 1.0 top_p."""
    generator = torch.Generator().manual_seed(seed)
    specs: list[tuple[torch.Tensor, int, float]] = []
    for scale in (8.0, 4.0, 1.0):
        for top_p in (0.95, 0.9, 0.5):
            specs.append((torch.randn(vocab, generator=generator) * scale, 0, top_p))
    tied = (torch.randn(vocab, generator=generator) * 2).round()  # a handful of values, all tied
    specs += [(tied, 0, 0.5), (tied, 0, 0.9), (tied, 30, 0.9), (tied, 30, 1.0)]
    masked = torch.randn(vocab, generator=generator) * 3
    grammar = torch.full((vocab,), -math.inf)
    grammar[: min(7, vocab)] = masked[:7]
    banned = masked.clone()
    banned[::2] = -math.inf
    biased = masked.clone()
    biased[vocab // 3] += 30.0
    specs += [(grammar, 0, 0.9), (grammar, 50, 0.99), (grammar, 50, 1.0), (banned, 0, 0.95)]
    single = torch.full((vocab,), -math.inf)
    single[vocab - 1] = -5.0
    specs += [(biased, 0, 0.5), (single, 0, 0.9)]
    medium = torch.randn(vocab, generator=generator) * 4
    specs += [(medium, 1, 0.9), (medium, 50, 0.95), (medium, vocab // 2, 0.9)]
    specs += [(medium, 20, 1.0), (medium, 0, 1e-7), (medium, 0, 1.0), (medium, 0, 0.999)]
    x = torch.stack([row for row, _, _ in specs])
    top_k = torch.tensor([[k] for _, k, _ in specs])
    top_p = torch.tensor([[p] for _, _, p in specs])
    return x, top_k, top_p


def kept(x: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """The finite tokens a cut-off keeps."""
    return (x >= cutoff) & x.isfinite()


def disagreements(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> dict:
    """The kernel's kept sets against float64 and the sorted rule (`engine.sampler`), per row:
    which rows differ and their float64 boundary gaps."""
    from engine.sampler import sorted_top_k_top_p_cutoffs

    exact = kept(x, nucleus_cutoffs_reference(x, top_k, top_p))
    ours = kept(x, nucleus_cutoffs(x, top_k, top_p))
    rule = kept(x, sorted_top_k_top_p_cutoffs(x, top_k, top_p))
    gaps = boundary_gaps(x, top_k, top_p)

    def differing(a: torch.Tensor, b: torch.Tensor) -> list[int]:
        return (a != b).any(dim=-1).nonzero().flatten().tolist()

    return {
        "kernel_vs_float64": differing(ours, exact),
        "kernel_vs_sorted": differing(ours, rule),
        "sorted_vs_float64": differing(rule, exact),
        "gaps": gaps.tolist(),
        "kept": ours.sum(-1).tolist(),
    }


# The sorted rule's own rounding (fp32 probabilities, an fp32 scan on CUDA) is looser.
SORTED_TOLERANCE = 2.0**-14


def _assert_rule_held(result: dict) -> None:
    gaps = result["gaps"]
    # the kernel's kept set is the float64 one wherever the mass is clear of top_p
    assert all(gaps[r] < MASS_TOLERANCE for r in result["kernel_vs_float64"]), result
    assert all(gaps[r] < SORTED_TOLERANCE for r in result["kernel_vs_sorted"]), result
    differ = result["kernel_vs_sorted"]
    kernel_exact = [r for r in differ if r not in result["kernel_vs_float64"]]
    print(
        f"rows {len(gaps)}: kernel vs float64 differ on {len(result['kernel_vs_float64'])}, "
        f"kernel vs sorted rule on {len(differ)} (float64 sides with the kernel on "
        f"{len(kernel_exact)}); gaps of those rows: {[f'{gaps[r]:.2g}' for r in differ]}"
    )


_INTERPRETED = """
import json
from tests.kernels.test_nucleus_cutoff import disagreements, rows_of_every_kind
print(json.dumps([disagreements(*rows_of_every_kind(vocab)) for vocab in {vocabs}]))
"""


def test_small_rows_follow_the_rule_in_the_interpreter() -> None:
    # 2,053: two full tiles and a tail of 5
    for result in run_interpreted(_INTERPRETED.format(vocabs=[2053])):
        _assert_rule_held(result)
        assert result["kernel_vs_float64"] == [], result  # no row this close at these sizes


def test_cases_cover_what_they_claim() -> None:
    x, top_k, top_p = rows_of_every_kind(1000)
    exact = kept(x, nucleus_cutoffs_reference(x, top_k, top_p)).sum(-1).tolist()
    assert exact[-3] == 1  # tiny top_p: the best token only
    assert exact[-2] == 1000  # top_p 1: untouched
    assert exact[18] == 1  # one token left by the mask, the last
    assert exact[12] > 30  # top_k 30 falls inside a tie: the whole tie stays
    assert exact[13] <= 7  # the grammar mask


_REAL_VOCAB = """
import json, torch
from tests.kernels.test_nucleus_cutoff import VOCAB, disagreements, rows_of_every_kind
x, k, p = rows_of_every_kind(VOCAB, seed=1)
pick = torch.tensor([21])  # medium, top_k 64,640 (both searches), top_p 0.9
print(json.dumps(disagreements(x[pick], k[pick], p[pick])))
"""


@pytest.mark.slow
def test_real_vocabulary_rows_follow_the_rule_in_the_interpreter() -> None:
    _assert_rule_held(run_interpreted(_REAL_VOCAB))


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    x, top_k, top_p = rows_of_every_kind(100)
    with pytest.raises(ValueError, match="CUDA"):
        nucleus_cutoffs(x, top_k, top_p)
    with pytest.raises(ValueError, match="fp32"):
        nucleus_cutoffs(x.double(), top_k, top_p)
    with pytest.raises(ValueError, match="per row"):
        nucleus_cutoffs(x, top_k[:3], top_p)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_kind_of_row_follows_the_rule_on_cuda(seed: int) -> None:
    result = disagreements(*(t.cuda() for t in rows_of_every_kind(VOCAB, seed)))
    _assert_rule_held(result)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [8.0, 4.0, 1.0])
def test_many_rows_at_the_real_vocabulary_on_cuda(scale: float) -> None:
    generator = torch.Generator().manual_seed(int(scale))
    x = (torch.randn(256, VOCAB, generator=generator) * scale).cuda()
    top_p = torch.tensor([(0.95, 0.9, 0.5, 0.8)[r % 4] for r in range(256)]).cuda()
    top_k = torch.tensor([(0, 0, 0, 50)[r % 4] for r in range(256)]).cuda()
    result = disagreements(x, top_k[:, None], top_p[:, None])
    _assert_rule_held(result)
    # rounding disagreements are rare: a boundary token within MASS_TOLERANCE of top_p
    assert len(result["kernel_vs_float64"]) <= 256 // 8, result["kernel_vs_float64"]
    # the batch does not move a row's cut-off
    alone = nucleus_cutoffs(x[5:6], top_k[5:6], top_p[5:6])
    assert torch.equal(alone, nucleus_cutoffs(x, top_k, top_p)[5:6])


def test_kernel_compiles_for_hopper_without_spills() -> None:
    # what the interpreter cannot show: the loops, branches and int64/int32 mixing type-check
    # for sm90, and the [1024, 16] comparison tiles stay in registers
    from kernels.nucleus_cutoff import _KEY_NEG_INF, _nucleus_cutoff_kernel
    from tests.kernels.interpreted import compile_for_hopper

    pointers = {"x_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "out_ptr": "*fp32"}
    ptx = compile_for_hopper(
        _nucleus_cutoff_kernel,
        {**pointers, "width": "i32", "row_stride": "i32"},
        {"KEY_NEG_INF": _KEY_NEG_INF, "BLOCK": 1024, "NUM": 16},
        {*pointers, "width", "row_stride"},
    )
    assert ".entry" in ptx and ".local" not in ptx
