"""CUDA-graph replay of a pure, token-parallel part of a forward (launch overhead, not maths).

A decode step issues thousands of small kernels; on the H200 the host, not the GPU, sets its
pace (~20 µs of Python and launch per kernel). `GraphedSegment` captures a function once per
token-count bucket and replays it with one launch. The function must be pure (no state writes,
no host reads), take tensors whose first dimension is the token count and return a tuple of such
tensors; rows are independent, so a batch runs padded to its bucket and the padding rows'
outputs are dropped.

Segments may share their input and output buffers (`buffers`): the 40 blocks of a model then
hold one set per bucket, not 40. Returned tensors are views of the output buffers: valid until
a segment sharing them runs again (the next block), which is how a block's outputs are used. A
bucket whose capture fails (an operation that cannot be captured) runs eagerly from then on;
`failures` says why.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# Token counts a graph is captured for; larger steps (prefill chunks) run eagerly.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `num_tokens` rows (None: larger than every bucket)."""
    index = bisect.bisect_left(buckets, num_tokens)
    return buckets[index] if index < len(buckets) else None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


class GraphedSegment:
    """`fn(*tensors) -> tuple[Tensor, ...]` replayed from CUDA graphs, one per bucket."""

    def __init__(
        self,
        fn: Callable[..., tuple[Tensor, ...]],
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        pool: tuple[int, int] | None = None,
        buffers: dict[tuple, Tensor] | None = None,
    ) -> None:
        """pool: a `torch.cuda.graph_pool_handle()` shared by segments that never run at once
        (their intermediates may then share memory). buffers: static inputs and outputs shared
        with such segments (keyed by bucket, role, shape and dtype)."""
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive token counts, got {buckets}")
        self.fn = fn
        self.buckets = tuple(buckets)
        self.pool = pool
        self.buffers = {} if buffers is None else buffers
        self.graphs: dict[int, _Captured] = {}
        self.failures: dict[int, str] = {}
        self.replays = 0

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        num_tokens = inputs[0].shape[0]
        bucket = bucket_for(num_tokens, self.buckets)
        if bucket is None or bucket in self.failures or not inputs[0].is_cuda:
            return self.fn(*inputs)
        captured = self.graphs.get(bucket) or self._capture(bucket, inputs)
        if captured is None:
            return self.fn(*inputs)
        for static, value in zip(captured.inputs, inputs, strict=True):
            static[:num_tokens].copy_(value)
        captured.graph.replay()
        self.replays += 1
        return tuple(out[:num_tokens] for out in captured.outputs)

    def capture(self, *inputs: Tensor) -> None:
        """Capture the bucket of `inputs` now (a first use would otherwise capture it: tens of
        milliseconds, with a device synchronisation)."""
        bucket = bucket_for(inputs[0].shape[0], self.buckets)
        if bucket is not None and bucket not in self.graphs and bucket not in self.failures:
            self._capture(bucket, inputs)

    def _static(self, key: tuple, like: Tensor, rows: int) -> Tensor:
        """The shared buffer for `key`: `rows` rows shaped like `like`'s, zero at creation."""
        full_key = (*key, rows, tuple(like.shape[1:]), like.dtype)
        if full_key not in self.buffers:
            shape = (rows, *like.shape[1:])
            self.buffers[full_key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.buffers[full_key]

    def _capture(self, bucket: int, inputs: tuple[Tensor, ...]) -> _Captured | None:
        # Padding rows hold zeros or earlier rows: finite through a token-parallel function.
        static = tuple(self._static(("in", i), x, bucket) for i, x in enumerate(inputs))
        for buffer, value in zip(static, inputs, strict=True):
            buffer[: value.shape[0]].copy_(value)
        try:
            # Warm up on a side stream first (Triton autotuning and compilation, cuBLAS
            # workspaces), as capture requires.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                results = self.fn(*static)
            torch.cuda.current_stream().wait_stream(side)
            outputs = tuple(self._static(("out", i), r, bucket) for i, r in enumerate(results))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                for output, result in zip(outputs, self.fn(*static), strict=True):
                    output.copy_(result)
        except RuntimeError as exc:
            self.failures[bucket] = f"{type(exc).__name__}: {exc}"
            logger.warning(  # the traceback with the segment's first failure only
                "CUDA graph capture failed for %d tokens; eager: %s",
                bucket,
                exc,
                exc_info=len(self.failures) == 1,
            )
            return None
        captured = _Captured(graph, static, outputs)
        self.graphs[bucket] = captured
        return captured
