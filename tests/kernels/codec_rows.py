"""Rows for the KV row codec kernels' tests: random blocks over a wide range of magnitudes with
the edge blocks of each format written into the first blocks (in a seeded order).

Edge blocks: all +0 / all -0 / mixed zeros, amax below the format's floor (float32 subnormals
included), ties at every element rounding midpoint and one float32 ulp either side (with random
signs), values at and above the saturation, scales in the subnormal range, ±inf and huge values.
"""

from __future__ import annotations

import torch
from torch import Tensor

SWA_DIMS = (64, 96, 128, 512)
INDEX_DIMS = (32, 64, 96, 128)
GLOBAL_DIMS = (16, 48, 64, 512)
ROW_COUNTS = (1, 7, 300)

_E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _with_neighbours(values: Tensor) -> Tensor:
    """values and the float32 just below and above each."""
    values = values.to(torch.float32)
    up = torch.nextafter(values, torch.full_like(values, float("inf")))
    down = torch.nextafter(values, torch.zeros_like(values))
    return torch.cat([values, up, down])


def _chunks(lead: float, values: Tensor, block: int, generator: torch.Generator) -> list[Tensor]:
    """Blocks of `block` elements: `lead` (the block's amax) then `values` with random signs."""
    signs = torch.where(torch.rand(values.shape, generator=generator) < 0.5, -1.0, 1.0)
    values = values * signs
    out = []
    for start in range(0, values.numel(), block - 1):
        chunk = values[start : start + block - 1]
        padded = torch.zeros(block)
        padded[0] = lead
        padded[1 : 1 + chunk.numel()] = chunk
        out.append(padded)
    return out


def _common(block: int, generator: torch.Generator) -> list[Tensor]:
    zeros = torch.zeros(block)
    mixed = zeros.clone()
    mixed[::2] = -0.0
    tiny = torch.randn(block, generator=generator)
    inf = torch.randn(block, generator=generator)
    inf[3] = float("inf")
    neg_inf = inf.clone()
    neg_inf[3] = float("-inf")
    return [
        zeros,
        -zeros,
        mixed,
        tiny * 1e-7,
        tiny * 1e-3,
        tiny * 1e-40,  # float32 subnormals
        tiny * 3e37,
        inf,
        neg_inf,
    ]


def swa_edges(generator: torch.Generator) -> list[Tensor]:
    """Edge blocks of the MXFP8 window rows (block 32, e4m3 elements, power-of-two scales)."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # every finite non-negative e4m3 value
    values = codes.view(torch.float8_e4m3fn).to(torch.float32)
    midpoints = (values[:-1] + values[1:]) / 2
    edges = _common(32, generator)
    edges += _chunks(448.0, _with_neighbours(midpoints), 32, generator)  # s = 1
    edges += _chunks(448.0 * 2.0**-20, _with_neighbours(midpoints) * 2.0**-20, 32, generator)
    edges += _chunks(480.0, torch.tensor([448.0, -448.0, 464.0, -479.0, 1e-9]), 32, generator)
    for amax in (448e-4, 0.0448, 448.0 * 2.0**-13, 448.0 * 2.0**10, 1e-4):
        edges += _chunks(amax, _with_neighbours(torch.tensor([amax, amax / 3])), 32, generator)
    return edges


def index_edges(generator: torch.Generator) -> list[Tensor]:
    """Edge blocks of the FP4 index rows (block 32, e2m1 elements, power-of-two scales)."""
    ties = _with_neighbours(torch.tensor([*_E2M1_BOUNDARIES, 6.0, 0.5, 3.0]))
    edges = _common(32, generator)
    for k in (0, -20, 40, -126, -130, -140, 120):  # -126 and below: subnormal elements
        edges += _chunks(6.0 * 2.0**k, ties * 2.0**k, 32, generator)
    edges += _chunks(6.5, torch.tensor([6.0, -6.25, 6.5, 0.1]), 32, generator)
    return edges


def global_edges(generator: torch.Generator, max_amax: float) -> list[Tensor]:
    """Edge blocks of the FP4 global rows (block 16, e2m1 elements, e4m3 scales); amax of the
    saturating blocks at most `max_amax` (the NeMo variant raises above 2784)."""
    ties = _with_neighbours(torch.tensor([*_E2M1_BOUNDARIES, 6.0, 0.5, 3.0]))
    edges = [block[:16] for block in _common(32, generator) if block.abs().max() < max_amax]
    # e4m3 scales: normal, ties of the scale rounding, subnormal (m * 2^-9), at the floor.
    for scale in (1.0, 1.125, 1.0625, 1.1875, 0.75 * 2.0**-6, 3 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-9):
        edges += _chunks(6.0 * scale, ties * scale, 16, generator)
    for amax in (6.0 * 448.0, 6.0 * 460.0, 2784.0, 6.0 * 464.0, 5000.0):
        if amax <= max_amax:
            edges += _chunks(amax, torch.tensor([amax / 7, 1.0, amax / 2]), 16, generator)
    return edges


def rows(
    edges: list[Tensor], num_rows: int, dim: int, seed: int, log2_range: tuple[int, int]
) -> Tensor:
    """float32 [num_rows, dim]: random blocks scaled by 2^U(log2_range), then as many edge blocks
    (in a seeded order) as fit."""
    block = edges[0].numel()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, dim // block, block, generator=generator)
    x = x * torch.exp2(torch.randint(*log2_range, (num_rows, dim // block, 1), generator=generator))
    flat = x.view(-1, block)
    order = torch.randperm(len(edges), generator=generator)
    for slot, k in enumerate(order[: flat.shape[0]].tolist()):
        flat[slot] = edges[k]
    return x.view(num_rows, dim)


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Equal dtype, shape and bytes (so -0.0 differs from 0.0; NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        a, b = a.view(width[a.element_size()]), b.view(width[b.element_size()])
    return torch.equal(a, b)
