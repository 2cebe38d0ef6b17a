"""Dense FP8 linears (`Numerics.dense_fp8`, `engine/models/deepseek_v41/dense.py`): the model holds
the checkpoint's FP8 bytes, runs them through the FP8 GEMM's numerics, and counts them in its
memory plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.memory import held_weight_bytes, planned_weight_bytes
from engine.models import Numerics, load_model, sequential_batch
from engine.models.deepseek_v41.checkpoint_loader import load_checkpoint, read_config
from engine.models.deepseek_v41.config import config_with
from engine.models.deepseek_v41.dense import FP8BlockLinear, grouped_linear
from engine.models.deepseek_v41.inventory import full_inventory
from engine.models.deepseek_v41.weight_formats import fp8_block_dequantize, fp8_block_quantize
from kernels.fp8_block_gemm import quantize_activations_reference

FP8 = Numerics(dense_fp8=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[0] + torch.randint(3, 1000, (n - 1,), generator=g).tolist() for n in (97, 40, 1)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


def _fake_quantized(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_activations_reference(x, 32)
    exponent = scales.view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(codes.float().unflatten(-1, (-1, 32)), exponent[..., None]).flatten(-2)


def _pair(n_out: int, n_in: int) -> tuple[FP8BlockLinear, nn.Linear]:
    weight, scale = fp8_block_quantize(torch.randn(n_out, n_in) * n_in**-0.5)
    fp8 = FP8BlockLinear(n_in, n_out, 32)
    fp8.load_state_dict({"weight": weight, "scale": scale})
    dense = nn.Linear(n_in, n_out, bias=False)
    dense.weight.data = fp8_block_dequantize(weight, scale)
    return fp8, dense


def test_fp8_linear_is_the_dequantized_linear_of_fp8_activations() -> None:
    torch.manual_seed(0)
    fp8, dense = _pair(96, 128)
    x = torch.randn(3, 5, 128)
    assert _rel(fp8(x), F.linear(_fake_quantized(x), dense.weight)) < 1e-6
    assert 1e-3 < _rel(fp8(x), dense(x)) < 5e-2  # what the activation quantization costs
    # the grouped form (`wo_a`): 4 groups of 64 inputs → 32 outputs each
    fp8, dense = _pair(4 * 32, 64)
    x = torch.randn(7, 4 * 64)
    expected = grouped_linear(dense, _fake_quantized(x), 4)
    assert _rel(grouped_linear(fp8, x, 4), expected) < 1e-6
    assert expected.shape == (7, 128)


def test_the_model_holds_the_checkpoints_fp8_bytes(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, numerics=FP8, progress=False)
    stored = load_checkpoint(tiny_checkpoint, progress=False, stored_kinds=("fp8",)).tensors
    held = model.state_dict()
    fp8_specs = [s for s in full_inventory(model.config) if s.kind == "fp8"]
    assert len(fp8_specs) > 30  # attention, indexer, shared experts, Engram, DSpark
    for spec in fp8_specs:
        module = model.get_submodule(spec.name.removesuffix(".weight"))
        assert isinstance(module, FP8BlockLinear), spec.name
        for name in (spec.name, spec.scale_name):
            assert held[name].dtype == stored[name].dtype
            assert torch.equal(held[name].view(torch.uint8), stored[name].view(torch.uint8))


def test_memory_plan_counts_the_fp8_dense_weights(tiny_checkpoint: Path) -> None:
    cfg = read_config(tiny_checkpoint)
    plan = planned_weight_bytes(cfg, 1, torch.float32, dense_fp8=True)
    assert held_weight_bytes(load_model(tiny_checkpoint, numerics=FP8, progress=False)) == plan
    dense = planned_weight_bytes(cfg, 1, torch.float32)
    fp8 = [s for s in full_inventory(cfg) if s.kind == "fp8"]
    elements = sum(s.shape[0] * s.shape[1] for s in fp8)
    scales = sum(-(-s.shape[0] // 32) * -(-s.shape[1] // 32) for s in fp8)
    assert dense.total - plan.total == elements * 4 - (elements + scales)


def test_released_rank_holds_half_the_dense_bytes_with_fp8() -> None:
    cfg = config_with()
    bf16 = planned_weight_bytes(cfg, 8, torch.bfloat16, True, "host")
    fp8 = planned_weight_bytes(cfg, 8, torch.bfloat16, True, "host", dense_fp8=True)
    saved = bf16.part("replicated") - fp8.part("replicated")
    # ≈ 7.4 G FP8 dense elements (trunk, shared experts, Engram wkv, DSpark): 1 B + 1/1024 B
    # each instead of 2 B; measured 57.06 → 50.18 GiB per rank (host Engram, MXFP4 experts)
    assert 6.8 * 2**30 < saved < 7.0 * 2**30
    assert fp8.part("experts") == bf16.part("experts")


def test_fp8_dense_logits_track_the_dequantized_model(tiny_checkpoint: Path) -> None:
    # The CPU runs the kernel's numerics as its torch reference. Random-weight models amplify
    # any perturbation (bf16 activations alone move `tiny`'s logits by 0.37 of their norm,
    # model.md §14); FP8 activations (3 mantissa bits) move them by 0.64 (measured): a
    # wrong block size, scale or group layout gives uncorrelated logits instead.
    exact = Numerics(kv_quantize=False)
    prompts = _prompts()
    reference = load_model(tiny_checkpoint, numerics=exact, progress=False).logits(prompts)
    fp8 = load_model(
        tiny_checkpoint, numerics=Numerics(kv_quantize=False, dense_fp8=True), progress=False
    ).logits(prompts)
    assert torch.isfinite(fp8).all()
    assert 1e-2 < _rel(fp8, reference) < 0.8
    corr = torch.corrcoef(torch.stack((fp8.flatten(), reference.flatten())))[0, 1]
    assert corr > 0.6


# ---- CUDA: the Triton kernel in the model ---------------------------------------------------


@pytest.mark.gpu
def test_cuda_fp8_model_matches_its_cpu_emulation(tiny_checkpoint: Path) -> None:
    numerics = Numerics(kv_quantize=False, dense_fp8=True)
    cpu_model = load_model(tiny_checkpoint, numerics=numerics, progress=False)
    gpu_model = load_model(tiny_checkpoint, device="cuda", numerics=numerics, progress=False)
    # every FP8 linear at the model's own weights, same input: the kernel vs the CPU reference
    on_gpu = dict(gpu_model.named_modules())
    linears = {n: m for n, m in cpu_model.named_modules() if isinstance(m, FP8BlockLinear)}
    assert linears
    g = torch.Generator().manual_seed(0)
    for name, linear in linears.items():
        x = torch.randn(5, linear.in_features, generator=g)
        assert _rel(on_gpu[name](x.cuda()), linear(x)) < 5e-4, name
    # The whole model: CUDA and the CPU round fp32 differently (~1e-6), and FP8 activation
    # codes turn that into whole-code steps that a random model amplifies. Perturbing the CPU
    # model's fp32 parameters by 1e-7 / 1e-6 / 1e-5 (relative) moves `tiny`'s FP8 logits by
    # 0.03 / 0.20 / 0.36 of their norm (measured); CUDA vs CPU measured 0.39. A wrong weight
    # layout or scale gives uncorrelated logits instead.
    prompts = _prompts()
    cpu, logits = cpu_model.logits(prompts), gpu_model.logits(prompts).cpu()
    assert torch.isfinite(logits).all() and _rel(logits, cpu) < 0.6
    assert torch.corrcoef(torch.stack((logits.flatten(), cpu.flatten())))[0, 1] > 0.8


def cuda_decode_logits(checkpoint: Path, numerics: Numerics, graphs: bool) -> torch.Tensor:
    """Logits of one decode step of four sequences after their prefill, on CUDA in bf16 with
    MXFP4 experts; `graphs`: the step replayed from CUDA graphs (none may fail to capture)."""
    prompts = [[0] + list(range(10, 10 + n)) for n in (30, 17, 45, 8)]
    model = load_model(
        checkpoint, device="cuda", dtype=torch.bfloat16, quantized_experts=True,
        numerics=numerics, progress=False,
    )  # fmt: skip
    batch, state = model.fresh_batch(prompts)
    with torch.inference_mode():
        model.forward_step(batch, state)
        if graphs:
            model.enable_cuda_graphs()
        positions = [len(p) for p in prompts]
        step = sequential_batch(
            [[7]] * 4, positions, [0, 1, 2, 3], batch.block_tables, device="cuda"
        )
        logits = model.forward_step(step, state).logits.float()
    assert model.graph_failures() == {}
    return logits


@pytest.mark.gpu
def test_cuda_graphs_replay_the_fp8_kernels(tiny_checkpoint: Path) -> None:
    graphed = cuda_decode_logits(tiny_checkpoint, FP8, True)
    assert torch.equal(graphed, cuda_decode_logits(tiny_checkpoint, FP8, False))


# ---- W8A16: the FP8 weights with bf16 activations (`Numerics.dense_fp8_activations` False) ----

W8A16 = Numerics(dense_fp8=True, dense_fp8_activations=False)


def _w8a16_pair(n_out: int, n_in: int) -> tuple[FP8BlockLinear, nn.Linear]:
    fp8, dense = _pair(n_out, n_in)
    w8a16 = FP8BlockLinear(n_in, n_out, 32, quantize_activations=False)
    w8a16.load_state_dict(fp8.state_dict())
    return w8a16, dense


def test_w8a16_linear_is_the_dequantized_linear() -> None:
    """Off the kernel path: the weight dequantized to x's dtype and the dense path's GEMM, so
    bit for bit the default model's linear (and `grouped_linear`'s groups)."""
    torch.manual_seed(0)
    w8a16, dense = _w8a16_pair(96, 128)
    x = torch.randn(3, 5, 128)
    assert torch.equal(w8a16(x), dense(x))
    w8a16, dense = _w8a16_pair(4 * 32, 64)
    x = torch.randn(7, 4 * 64)
    assert torch.equal(grouped_linear(w8a16, x, 4), grouped_linear(dense, x, 4))


def test_w8a16_model_gives_the_default_models_logits(tiny_checkpoint: Path) -> None:
    prompts = _prompts()
    exact = Numerics(kv_quantize=False)
    reference = load_model(tiny_checkpoint, numerics=exact, progress=False).logits(prompts)
    numerics = Numerics(kv_quantize=False, dense_fp8=True, dense_fp8_activations=False)
    model = load_model(tiny_checkpoint, numerics=numerics, progress=False)
    assert any(isinstance(m, FP8BlockLinear) for m in model.modules())
    assert held_weight_bytes(model) == planned_weight_bytes(
        read_config(tiny_checkpoint), 1, torch.float32, dense_fp8=True
    )
    assert torch.equal(model.logits(prompts), reference)


_W8A16_INTERPRETED = """
import json
import torch
from tests.models.test_dense_fp8 import _w8a16_pair
torch.manual_seed(0)
errors = []
for rows, groups in ((5, 1), (300, 1), (9, 2)):  # the kernel, the dequantized weight, groups
    w8a16, dense = _w8a16_pair(64 * groups, 128)
    x = torch.randn(rows, 128 * groups).bfloat16()
    ours = w8a16(x, groups).float()
    weight = dense.weight.bfloat16().float()
    if groups == 1:
        expected = x.float() @ weight.T
    else:
        parts = x.float().unflatten(-1, (groups, -1))
        expected = torch.einsum("tgk,gnk->tgn", parts, weight.unflatten(0, (groups, -1)))
        expected = expected.flatten(-2)
    errors.append(float((ours - expected).norm() / expected.norm()))
print(json.dumps(errors))
"""


@pytest.mark.slow
def test_w8a16_linear_on_the_kernel_path_in_the_triton_interpreter() -> None:
    """bf16 x through `kernels.fp8_weight_gemm` (a decode step's rows) or the weight
    dequantized by `dequantize_fp8_weight` (more rows): the bf16 path's products, within one
    bf16 rounding of the output."""
    from tests.kernels.interpreted import run_interpreted

    assert all(error < 4e-3 for error in run_interpreted(_W8A16_INTERPRETED))


@pytest.mark.gpu
def test_cuda_w8a16_model_tracks_the_bf16_model(tiny_checkpoint: Path) -> None:
    """The same products as the bf16 path (sums in another order), whole model on the GPU,
    with CUDA graphs replaying the kernels' K splits."""
    w8a16 = cuda_decode_logits(tiny_checkpoint, W8A16, True)
    assert torch.equal(w8a16, cuda_decode_logits(tiny_checkpoint, W8A16, False))
    bf16 = cuda_decode_logits(tiny_checkpoint, Numerics(), False)
    # NOTE: bounds not yet measured; a random model amplifies each flipped bf16 rounding, a
    # wrong weight layout or scale gives uncorrelated logits instead
    assert _rel(w8a16, bf16) < 0.3
    assert torch.corrcoef(torch.stack((w8a16.flatten(), bf16.flatten())))[0, 1] > 0.95


@pytest.mark.gpu
def test_cuda_w8a16_linears_match_the_dequantized_weights(tiny_checkpoint: Path) -> None:
    """Every FP8 linear of the model at its own weights, on the kernel (5 rows) and on the
    dequantized weight (300 rows): the bf16 GEMM's result within one bf16 rounding."""
    model = load_model(
        tiny_checkpoint, device="cuda", dtype=torch.bfloat16, numerics=W8A16, progress=False
    )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, FP8BlockLinear)}
    assert linears
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, linear in linears.items():
        weight = fp8_block_dequantize(linear.weight, linear.scale).bfloat16().float()
        for rows in (5, 300):
            x = torch.randn(rows, linear.in_features, generator=g, device="cuda").bfloat16()
            assert _rel(linear(x), x.float() @ weight.T) < 4e-3, (name, rows)
