"""Triton kernels, one per module: a launcher that checks layouts, and a torch reference.

`kernels` is a leaf: it imports torch and Triton, never `engine` (the model calls kernels, not the
other way round). Whether Triton runs its CPU interpreter is Triton's own setting
(`TRITON_INTERPRET`, read by Triton into `triton.knobs`); the kernels ask Triton, not the
environment.
"""

from __future__ import annotations

import triton
from torch import Tensor


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (Triton's `TRITON_INTERPRET=1`)."""
    return bool(triton.knobs.runtime.interpret)


def runs_kernels(tensor: Tensor) -> bool:
    """Whether the kernels take tensors like `tensor`: on CUDA, or anywhere while Triton runs
    its CPU interpreter (where a whole model can take its kernel paths, slowly, on the CPU)."""
    return tensor.is_cuda or interpreting()


def check_runnable(tensor: Tensor, kernel: str) -> None:
    """Raise ValueError unless `tensor` is on CUDA or Triton's CPU interpreter is on."""
    if not tensor.is_cuda and not interpreting():
        raise ValueError(f"{kernel} runs on CUDA (or Triton's CPU interpreter)")
