"""One CUDA graph per decode step: the whole `forward_step`, the attention's stateful middle
included (`--cuda-graph-mode step`).

The block graphs (`graphed.py`, `--cuda-graph-mode segments`) replay only the pure parts around
each layer's attention middle; its writes, selections and kernels still launch one by one, so a
decode step is host-bound. Here a decode step runs as a `PaddedDecodeBatch` (`decode_batch.py`:
fixed shapes, no host reads) padded to a step shape

    (rows, blocks) = (smallest row bucket ≥ sequences, smallest 2^k or 3·2^k ≥ table width)

whose graph is captured on first use (logged) and replayed with one launch after copying the
step's metadata into its static buffers. A capture failure sends that shape to the caller's
eager path from then on (`failures`). The logits of the real rows are returned as a fresh
tensor (the output buffer, shared by every shape's graph, is overwritten by the next replay).
The graphs share one memory pool: they never run at once and keep no output of their own.

Eligible steps (`StepGraphs.run` returns None for the others): CUDA, one new token per
sequence, no prefix-cache replay, no decoder floors, logits for every row, not batch-invariant
and no record kept (the caller's choice), at most `row_buckets[-1]` sequences.

NOTE: a capture first runs the step eagerly (warm-up on a side stream: Triton compilation and
autotuning, cuBLAS workspaces), then captures it, then replays it: the step's state writes run
twice with the same values (a decode step never reads a row it writes later in the step), so
the state is as after one step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.models.deepseek_v41.decode_batch import DecodeBuffers, can_pad
from engine.models.deepseek_v41.state import ModelState, StepBatch
from engine.models.graphed import bucket_for

if TYPE_CHECKING:
    from engine.models.deepseek_v41.model import DeepseekV41ForCausalLM

logger = logging.getLogger(__name__)

# Sequences per decode step a graph is captured for.
DEFAULT_ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def blocks_bucket(width: int) -> int:
    """Block-table columns of the step shape holding a table `width` blocks wide: the
    smallest 2^k or 3·2^k ≥ width (the indexer then scores at most 1.5× the keys it must)."""
    power = 1 << max(0, width - 1).bit_length()
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= width else power


@dataclass
class _StepGraph:
    graph: torch.cuda.CUDAGraph
    buffers: DecodeBuffers


class StepGraphs:
    """Decode steps of `model` over `state` replayed from one CUDA graph per step shape."""

    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        state: ModelState,
        row_buckets: tuple[int, ...] = DEFAULT_ROW_BUCKETS,
    ) -> None:
        """Raises ValueError off CUDA, for a state without a scratch slot
        (`allocate_state(reserve_scratch=True)`), for routed experts off the grouped MXFP4
        kernel (the per-expert path reads expert counts on the host: no capture could
        succeed), for host-resident Engram tables (their per-step row gathers are host work)
        or for batch-invariant numerics."""
        if model.device.type != "cuda":
            raise ValueError("step graphs need the model on a CUDA device")
        if not (model.quantized_experts and model.dtype == torch.bfloat16):
            raise ValueError("step graphs need bfloat16 with MXFP4 routed experts")
        if state.scratch_slot is None or state.trash_block is None:
            raise ValueError("step graphs need a state with a scratch slot (reserve_scratch)")
        if model.host_engram_tables():
            raise ValueError("step graphs cannot hold host-resident Engram gathers")
        if model.numerics.batch_invariant:
            raise ValueError("step graphs do not run batch-invariant numerics")
        if list(row_buckets) != sorted(set(row_buckets)) or not row_buckets or row_buckets[0] < 1:
            raise ValueError(f"row buckets must be increasing positive counts, got {row_buckets}")
        self.model = model
        self.state = state
        # No more rows than the state has slots for (its last slot is the scratch slot).
        top = bucket_for(state.num_slots - 1, row_buckets) or row_buckets[-1]
        self.row_buckets = tuple(b for b in row_buckets if b <= top)
        self.pool = torch.cuda.graph_pool_handle()
        # Every graph writes its logits here (a private output per shape would keep one
        # [rows, vocab] buffer per shape alive); `run` copies them out before the next replay.
        self._logits: Tensor | None = None
        self.graphs: dict[tuple[int, int], _StepGraph] = {}
        self.failures: dict[tuple[int, int], str] = {}
        self.replays = 0

    def shape_for(self, batch: StepBatch) -> tuple[int, int] | None:
        """The (rows, blocks) step shape of `batch`, None when it is not an eligible step."""
        if not batch.token_ids.is_cuda or not can_pad(batch):
            return None
        rows = bucket_for(batch.num_seqs, self.row_buckets)
        if rows is None:
            return None
        return rows, blocks_bucket(batch.block_tables.shape[1])

    def run(self, batch: StepBatch) -> Tensor | None:
        """fp32 logits [sequences, vocab] of decode step `batch` (extending the state as
        `forward_step` does), or None without running anything: not eligible, or its shape's
        capture failed; the caller then runs `forward_step`.

        NOTE: when a capture fails after its warm-up ran the step, the state holds the step's
        writes already; the caller's `forward_step` writes the same values again."""
        shape = self.shape_for(batch)
        if shape is None or shape in self.failures:
            return None
        step = self.graphs.get(shape)
        if step is None:
            step = self._capture(shape, batch)
            if step is None:
                return None
        step.buffers.fill(batch)
        step.graph.replay()
        self.replays += 1
        return self._logits[: batch.num_seqs].clone()

    def _capture(self, shape: tuple[int, int], batch: StepBatch) -> _StepGraph | None:
        rows, blocks = shape
        start = time.perf_counter()
        model, state = self.model, self.state
        device = batch.token_ids.device
        buffers = DecodeBuffers(rows, blocks, state, device)
        buffers.fill(batch)
        if self._logits is None:
            vocab = model.config.vocab_size
            self._logits = torch.empty(self.row_buckets[-1], vocab, device=device)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model.forward_step(buffers.batch(), state)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._logits[:rows].copy_(model.forward_step(buffers.batch(), state).logits)
        except RuntimeError as exc:
            self.failures[shape] = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "step graph capture failed for %d rows × %d blocks; eager: %s",
                rows,
                blocks,
                exc,
                exc_info=len(self.failures) == 1,
            )
            return None
        step = _StepGraph(graph, buffers)
        self.graphs[shape] = step
        logger.info(
            "step graph captured for %d rows × %d blocks in %.2f s",
            rows,
            blocks,
            time.perf_counter() - start,
        )
        return step

    def graph_failures(self) -> dict[str, str]:
        """Why a step shape runs eagerly (empty when every capture succeeded)."""
        return {f"step[{rows}x{blocks}]": why for (rows, blocks), why in self.failures.items()}
