"""Triton kernels, one per module: a launcher that checks layouts, and a torch reference."""

from __future__ import annotations

from torch import Tensor

from engine import envs


def check_runnable(tensor: Tensor, kernel: str) -> None:
    """Raise ValueError unless `tensor` is on CUDA or Triton's CPU interpreter is on."""
    if not tensor.is_cuda and not envs.triton_interpreter():
        raise ValueError(f"{kernel} runs on CUDA (or Triton's CPU interpreter)")
