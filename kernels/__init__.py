"""Triton kernels, one per module: a launcher that checks layouts, and a torch reference.

`kernels` is a leaf: it imports torch and Triton, never `engine` (the model calls kernels, not the
other way round). Whether Triton runs its CPU interpreter is Triton's own setting
(`TRITON_INTERPRET`, read by Triton into `triton.knobs`); the kernels ask Triton, not the
environment.
"""

from __future__ import annotations

import functools

import torch
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


def on_sm90(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.0: the Gluon kernels' target)."""
    return device.type == "cuda" and _capability(_device_index(device)) == (9, 0)


def multiprocessors(device: torch.device) -> int:
    """The number of SMs of the CUDA device `device`."""
    return _multiprocessors(_device_index(device))


def _device_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
