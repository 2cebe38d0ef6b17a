"""The numerical primitives against hand-derived facts of `model.md` §2–§3."""

from __future__ import annotations

import math

import torch

from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.primitives import (
    apply_rope,
    clamped_swiglu,
    mhc_combine,
    mhc_post,
    mhc_triplet,
    rms_norm,
    rope_frequencies,
    sqrtsoftplus_route,
)


def test_rms_norm_fp32_stats_and_zero_rows() -> None:
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.bfloat16)
    w = torch.tensor([2.0, 0.5], dtype=torch.bfloat16)
    y = rms_norm(x, w, 1e-20)
    assert y.dtype == torch.bfloat16
    rms = math.sqrt((9 + 16) / 2)
    assert torch.allclose(y[0].float(), torch.tensor([3 / rms * 2, 4 / rms * 0.5]), rtol=1e-2)
    assert torch.equal(y[1].float(), torch.zeros(2))  # eps 1e-20: zero row stays zero, no NaN


def test_yarn_keeps_high_frequencies_and_divides_low_ones() -> None:
    cfg = DeepseekV41Config()
    plain = rope_frequencies(64, cfg.compress_rope_theta, None)
    yarn = rope_frequencies(64, cfg.compress_rope_theta, cfg.rope_scaling)
    # Released values: lo = 15, hi = 25 (model.md §2.2).
    assert torch.equal(yarn[:15], plain[:15])
    assert torch.allclose(yarn[25:], plain[25:] / 16)
    ramp = (torch.arange(15, 25) - 15) / 10
    assert torch.allclose(yarn[15:25], plain[15:25] * (ramp / 16 + 1 - ramp))
    main = rope_frequencies(64, 10000.0, None)
    assert torch.allclose(main, 10000.0 ** (-torch.arange(0, 64, 2) / 64))


def test_rope_rotates_adjacent_pairs_of_the_tail_only() -> None:
    freqs = rope_frequencies(4, 10000.0, None)  # two pairs
    x = torch.arange(8, dtype=torch.float32)[None, :]  # 4 untouched + 4 rotated
    pos = torch.tensor([3])
    y = apply_rope(x, pos, freqs)
    assert torch.equal(y[0, :4], x[0, :4])
    a, b = x[0, 4].item(), x[0, 5].item()
    angle = 3 * freqs[0].item()
    assert math.isclose(y[0, 4].item(), a * math.cos(angle) - b * math.sin(angle), rel_tol=1e-5)
    assert math.isclose(y[0, 5].item(), a * math.sin(angle) + b * math.cos(angle), rel_tol=1e-5)
    back = apply_rope(y, pos, freqs, inverse=True)
    assert torch.allclose(back, x, atol=1e-5)


def test_rope_makes_dot_products_relative() -> None:
    freqs = rope_frequencies(16, 160000.0, DeepseekV41Config().rope_scaling)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 16, generator=g)
    d1 = (apply_rope(q, torch.tensor([10]), freqs) * apply_rope(k, torch.tensor([4]), freqs)).sum()
    d2 = (
        apply_rope(q, torch.tensor([106]), freqs) * apply_rope(k, torch.tensor([100]), freqs)
    ).sum()
    assert math.isclose(d1.item(), d2.item(), rel_tol=1e-4)


def _triplet(seed: int = 0, tokens: int = 5, n: int = 4, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(tokens, n, d, generator=g)
    fn = torch.randn(2 * n + n * n, n * d, generator=g) * 0.1
    base = torch.randn(2 * n + n * n, generator=g)
    scale = torch.rand(3, generator=g)
    return residual, mhc_triplet(residual, fn, base, scale, 1e-20, 1e-6, 20)


def test_mhc_sinkhorn_is_doubly_stochastic_and_gates_are_bounded() -> None:
    _, (pre, post, comb) = _triplet()
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-5)  # columns (last step)
    assert torch.allclose(comb.sum(-1), torch.ones(5, 4), atol=1e-3)  # rows (converged)
    assert ((pre > 0) & (pre <= 1 + 1e-6)).all()
    assert ((post >= 0) & (post <= 2)).all()


def test_mhc_post_contracts_over_the_source_stream() -> None:
    residual, (_, post, comb) = _triplet(1)
    y = torch.randn(5, 8)
    out = mhc_post(residual, post, comb, y)
    t, i = 2, 3
    expected = post[t, i] * y[t] + sum(comb[t, j, i] * residual[t, j] for j in range(4))
    assert torch.allclose(out[t, i], expected, atol=1e-5)
    wrong = post[t, i] * y[t] + sum(comb[t, i, j] * residual[t, j] for j in range(4))
    assert not torch.allclose(out[t, i], wrong, atol=1e-3)


def test_mhc_combine_defaults_to_stream_zero() -> None:
    residual = torch.randn(3, 4, 8)
    assert torch.equal(mhc_combine(residual, None), residual[:, 0])
    w = torch.tensor([0.5, 0.25, 0.0, 1.0]).expand(3, 4)
    assert torch.allclose(
        mhc_combine(residual, w), 0.5 * residual[:, 0] + 0.25 * residual[:, 1] + residual[:, 3]
    )


def test_routing_bias_steers_choice_but_never_scales_weights() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    ids, w = sqrtsoftplus_route(logits, torch.zeros(4), 2, 1.5)
    s = torch.sqrt(torch.nn.functional.softplus(logits))
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(w, s[:, :2] / s[:, :2].sum() * 1.5)
    ids_b, w_b = sqrtsoftplus_route(logits, torch.tensor([0.0, 0.0, 0.0, 10.0]), 2, 1.5)
    assert sorted(ids_b[0].tolist()) == [0, 3]
    chosen = s[0, ids_b[0]]
    assert torch.allclose(w_b[0], chosen / chosen.sum() * 1.5)
    assert math.isclose(w_b.sum().item(), 1.5, rel_tol=1e-6)


def test_clamped_swiglu_limits() -> None:
    gate = torch.tensor([100.0, -100.0, 1.0])
    up = torch.tensor([100.0, -100.0, 2.0])
    out = clamped_swiglu(gate, up, 10.0)
    silu = torch.nn.functional.silu
    assert torch.allclose(
        out,
        torch.stack(
            [
                silu(torch.tensor(10.0)) * 10,
                silu(torch.tensor(-100.0)) * -10,
                silu(torch.tensor(1.0)) * 2,
            ]
        ),
    )
