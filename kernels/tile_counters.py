"""Per-device int32 counters, zero between launches, for kernels whose programs count
themselves done on a tile and let the tile's last program finish it in the same launch
(`kernels.mhc_triplet`'s one launch, `kernels.fp8_weight_gemm`'s K splits). Each such last
program puts its counter back to zero, so a captured CUDA graph replays the launch as it is.

One buffer per device: the model's launches on a device run in one stream's order (a graph's
capture warms up on a side stream first, then captures, never both at once), so launches never
share counters at the same time. A buffer that grows stays alive in `_OUTGROWN`: graphs
captured before still point at it.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

_COUNTERS: dict[torch.device, Tensor] = {}
_OUTGROWN: list[Tensor] = []
_MIN_COUNTERS = 1024  # tiles: 65,536 tokens at `mhc_triplet`'s 64-token tile


def tile_counters(device: torch.device, num_tiles: int) -> Tensor | None:
    """`device`'s zeroed counters for `num_tiles` tiles, made (or grown) here; None where they
    must grow while a CUDA graph is being captured (the caller then launches without them)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < num_tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if counters is not None:
            _OUTGROWN.append(counters)
        size = max(_MIN_COUNTERS, triton.next_power_of_2(num_tiles))
        counters = _COUNTERS[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters
