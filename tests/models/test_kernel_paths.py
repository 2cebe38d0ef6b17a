"""The whole model on its kernel paths (Triton's CPU interpreter) against its torch paths.

Under `TRITON_INTERPRET=1` every `runs_kernels` branch takes its Triton kernel, so `tiny` in
float32 with exact KV storage runs the code a GPU runs: its logits must match the CPU torch
run to fp32 summation-order noise (measured 1.2e-6 relative).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import Numerics, load_model
from tests.kernels.interpreted import run_interpreted

PROMPTS = [[0, 17, 503, 44, 9, 871, 23, 5], [0, 999, 3]]

_INTERPRETED = """
import json, torch
from engine.models import Numerics, load_model
from tests.models.test_kernel_paths import PROMPTS
model = load_model({checkpoint!r}, numerics=Numerics(kv_quantize=False))
torch.save(model.logits(PROMPTS), {out!r})
print(json.dumps(True))
"""


@pytest.mark.slow  # a tiny-model run in the interpreter, ~7 s
def test_tiny_on_the_kernel_paths_matches_the_torch_paths(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "logits.pt"
    run_interpreted(_INTERPRETED.format(checkpoint=str(tiny_checkpoint), out=str(out)))
    kernels = torch.load(out)
    torch_paths = load_model(tiny_checkpoint, numerics=Numerics(kv_quantize=False)).logits(PROMPTS)
    assert kernels.shape == torch_paths.shape and kernels.dtype == torch.float32
    rel = float((kernels - torch_paths).norm() / torch_paths.norm())
    assert rel < 1e-5, rel
