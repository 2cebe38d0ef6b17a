"""How many new positions a step may take: an activation-memory budget and a step-time target.

The scheduler asks `StepBudget.max_chunk` for every chunk it adds to a step; the answer bounds
the chunk so that the step's estimated activation memory stays within the memory budget and
its predicted time within the target step time. Both estimates are linear in the features of
the step's *padded* shape, because the model pads each step to `[num_seqs, max_new_tokens]`
and its indexer scores every padded row against every visible compressed position:

    rows         = num_seqs * max_new_tokens         (padded query rows; decode rows that run
                                                     apart, see below, count one each)
    pairs        = rows * max_context                 (indexer scores / masks [B, T_max, J])
    seq_context  = num_seqs * max_context             (gathered index keys [B, J, dim])

    cost(shape)  = c0 + c_seq * num_seqs + c_row * rows + c_pair * pairs + c_ctx * seq_context

With step graphs the runner runs a mixed step's leading decode rows as a forward of their own
(`model_runner.split_decode_rows`), so they are not padded to the longest chunk: a budget made
with `decode_rows_apart` prices those `num_apart` rows as one row each.

Memory uses fixed coefficients derived from the model's widths (`ActivationCost`); time uses
coefficients fitted online from the engine's own steps (`StepTimeModel`), starting from a
conservative prior. Pure Python (the scheduler imports it; no torch).

Contract: `max_chunk` returns at least 1 while the step holds no multi-token chunk (so decode
rows, which come first, are never dropped, and the first prefill chunk always progresses), and
0 when even one more position would exceed a bound of a step that already holds one (the
request waits for the next step); `max_context_len` is the longest context whose one-token
step fits the memory budget (longer requests can never run).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

NUM_FEATURES = 5


def num_leading_rows(lengths: Iterable[int]) -> int:
    """How many of a step's chunk lengths, in batch order, are one token before the first
    longer chunk: its decode rows (`StepShape.num_apart`, `split_decode_rows`)."""
    count = 0
    for length in lengths:
        if length != 1:
            break
        count += 1
    return count


@dataclass(frozen=True)
class StepShape:
    """The padded shape of a step: sequences, longest new chunk, furthest end position, and
    how many of the sequences lead the step with one new token each (its decode rows)."""

    num_seqs: int = 0
    max_new_tokens: int = 0
    max_context: int = 0
    num_apart: int = 0  # leading one-token rows (priced unpadded only where they run apart)

    def with_chunk(self, num_new: int, end_position: int) -> StepShape:
        """This shape with one more sequence, after the others, computing `num_new` positions
        up to `end_position` (exclusive)."""
        leads = num_new == 1 and self.num_apart == self.num_seqs
        return StepShape(
            self.num_seqs + 1,
            max(self.max_new_tokens, num_new),
            max(self.max_context, end_position),
            self.num_apart + leads,
        )

    def features(self) -> tuple[float, ...]:
        """(1, num_seqs, rows, pairs, seq_context), the terms every cost is linear in."""
        rows = self.num_apart + (self.num_seqs - self.num_apart) * self.max_new_tokens
        return (
            1.0,
            float(self.num_seqs),
            float(rows),
            float(rows * self.max_context),
            float(self.num_seqs * self.max_context),
        )


@dataclass(frozen=True)
class LinearCost:
    """`cost = Σ coef_i · feature_i` over `StepShape.features()`."""

    coefs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.coefs) != NUM_FEATURES or any(c < 0 for c in self.coefs):
            raise ValueError(f"LinearCost needs {NUM_FEATURES} non-negative coefficients")

    def __call__(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self.coefs, shape.features(), strict=True))


# Scratch buffers the model bounds by element counts (attention.py): the indexer's per-group
# dot products and their ReLU (2^25 fp32 each).
_INDEX_SCRATCH_BYTES = 2 * 4 * (1 << 25)


def activation_cost(
    *,
    hidden_size: int,
    hc_mult: int,
    num_heads: int,
    head_dim: int,
    sliding_window: int,
    index_topk: int,
    index_head_dim: int,
    vocab_size: int,
) -> LinearCost:
    """Bytes of activation of one step of the DeepSeek-V4.1 forward (fp32 intermediates), an
    upper estimate from the model's widths (measured against it: `benchmarks/prefill_memory.py`).

    per row:  gathered global rows [K, hd] (stored, decoded, fp32), the banded window scores and
              probabilities [H, ~2W], the mHC streams [N, D] and their temporaries, q / o [H, hd];
    per pair: the indexer's scores, masked scores, visibility and candidate masks over
              [rows, context] (fp32 + bool, at most about 16 bytes live at once);
    per (sequence, context): the gathered index keys [J, dim] (encoded and decoded fp32);
    per sequence: its logits row and the sampler's copies of it.
    """
    floats_per_row = (
        3 * index_topk * head_dim
        + 6 * num_heads * 2 * sliding_window
        + 12 * hc_mult * hidden_size
        + 6 * num_heads * head_dim
    )
    return LinearCost(
        (
            float(_INDEX_SCRATCH_BYTES),
            4.0 * 4 * vocab_size,
            4.0 * floats_per_row,
            16.0,
            4.0 * 3 * index_head_dim,
        )
    )


# Prior seconds per feature unit: (step, sequence, row, pair, sequence·context). Deliberately
# slow (an unloaded 2-core CPU on the `default` model is about 3x faster), so that the first
# prefill chunks are small; the fit replaces it within a few steps.
CPU_TIME_PRIOR = LinearCost((0.3, 0.02, 3e-3, 3e-6, 3e-5))
CUDA_TIME_PRIOR = LinearCost((0.02, 1e-3, 5e-5, 2e-10, 1e-7))
# Feature values at which the prior counts `prior_weight` observations (a short prefill chunk):
# (step, sequences, rows, pairs, sequence·context).
PRIOR_SCALES = (1.0, 4.0, 64.0, 64.0 * 2048, 4.0 * 2048)
# No fitted coefficient falls below this share of the prior's (a feature the recent steps
# cannot tell apart from the others is never taken to be free).
PRIOR_FLOOR = 0.125


class StepTimeModel:
    """Step seconds as a `LinearCost` fitted to the engine's recent steps.

    Ridge least squares of the relative error with exponential forgetting (an observation's
    weight halves about every `0.7 * window` steps), pulled toward `prior` with the weight of
    `prior_weight` observations at each feature's typical (RMS) value (at least
    `PRIOR_SCALES`), so that a feature no step exercised yet (long prefills during a
    decode-only stretch) keeps its prior value, and a pessimistic prior gives way to the
    measurements within tens of steps.
    Coefficients stay non-negative (a negative one is pinned to 0 and the rest refitted, as
    in an active-set NNLS), and at least `PRIOR_FLOOR` of the prior's. `observe` mutates;
    `predict` does not.
    """

    def __init__(self, prior: LinearCost, *, window: int = 256, prior_weight: float = 2.0):
        self.prior = prior
        self.prior_weight = prior_weight
        self._decay = 1.0 - 1.0 / window
        self._xx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]  # Σ w·x·xᵀ
        self._xy = [0.0] * NUM_FEATURES  # Σ w·x·y
        self._cost = prior

    @property
    def cost(self) -> LinearCost:
        return self._cost

    def predict(self, shape: StepShape) -> float:
        return self._cost(shape)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record one executed step (its padded shape and wall time) and refit."""
        if shape.num_seqs == 0 or seconds < 0:
            return
        # Relative errors: a step's weight is 1 / seconds² (timing noise grows with the time).
        x = shape.features()
        weight = 1.0 / max(seconds, 1e-4) ** 2
        for r in range(NUM_FEATURES):
            self._xy[r] = self._decay * self._xy[r] + weight * x[r] * seconds
            for c in range(NUM_FEATURES):
                self._xx[r][c] = self._decay * self._xx[r][c] + weight * x[r] * x[c]
        floors = [PRIOR_FLOOR * p for p in self.prior.coefs]
        self._cost = LinearCost(tuple(map(max, self._fit(), floors)))

    def _fit(self) -> tuple[float, ...]:
        # Unknowns scaled by each feature's RMS over the (decayed) observations, at least its
        # prior scale: u_i = coef_i * m_i, so the prior weighs as `prior_weight` typical steps.
        count = max(self._xx[0][0], 1e-9)  # feature 0 is the constant 1: Σ weights
        m = [max(math.sqrt(self._xx[i][i] / count), PRIOR_SCALES[i]) for i in range(NUM_FEATURES)]
        prior = [p * s for p, s in zip(self.prior.coefs, m, strict=True)]
        pinned: set[int] = set()
        while True:
            free = [i for i in range(NUM_FEATURES) if i not in pinned]
            a = [[self._xx[r][c] / (m[r] * m[c]) for c in free] for r in free]
            b = [self._xy[r] / m[r] for r in free]
            for k, i in enumerate(free):
                a[k][k] += self.prior_weight
                b[k] += self.prior_weight * prior[i]
            u = dict(zip(free, _solve(a, b), strict=True))
            negative = {i for i in free if u[i] < 0}
            if not negative:
                return tuple(u.get(i, 0.0) / m[i] for i in range(NUM_FEATURES))
            pinned |= negative


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is symmetric positive definite here)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class StepBudget:
    """The scheduler's bound on each chunk: memory budget and target step time.

    memory: bytes of activation of a step (None: no memory bound); memory_bytes: the budget.
    time_model: predicted step seconds (None: no time bound); target_step_s: the target.
    decode_rows_apart: a step's leading decode rows run as a forward of their own (step
    graphs), so `StepShape.num_apart` rows are priced unpadded; otherwise every row pads.
    """

    def __init__(
        self,
        memory: LinearCost | None = None,
        memory_bytes: float | None = None,
        time_model: StepTimeModel | None = None,
        target_step_s: float | None = None,
        *,
        decode_rows_apart: bool = False,
    ) -> None:
        if (memory is None) != (memory_bytes is None):
            raise ValueError("give both memory and memory_bytes, or neither")
        if (time_model is None) != (target_step_s is None):
            raise ValueError("give both time_model and target_step_s, or neither")
        if memory_bytes is not None and memory_bytes <= 0:
            raise ValueError("memory_bytes must be > 0")
        if target_step_s is not None and target_step_s <= 0:
            raise ValueError("target_step_s must be > 0")
        self.memory = memory
        self.memory_bytes = memory_bytes
        self.time_model = time_model
        self.target_step_s = target_step_s
        self.decode_rows_apart = decode_rows_apart

    def priced(self, shape: StepShape) -> StepShape:
        """`shape` as this budget's costs see it: its apart rows padded unless they run apart."""
        if self.decode_rows_apart or not shape.num_apart:
            return shape
        return StepShape(shape.num_seqs, shape.max_new_tokens, shape.max_context)

    def fits(self, shape: StepShape) -> bool:
        """Whether a step of this shape is within both bounds. No mutation."""
        shape = self.priced(shape)
        if self.memory is not None and self.memory(shape) > self.memory_bytes:
            return False
        return self.time_model is None or self.time_model.predict(shape) <= self.target_step_s

    def max_chunk(self, shape: StepShape, start_position: int, num_wanted: int) -> int:
        """The most positions (0 .. num_wanted) a chunk starting at `start_position` may add
        to a step of `shape` within the bounds. When even one exceeds them: 1 if `shape` holds
        no multi-token chunk (progress), else 0. No mutation.

        NOTE: costs grow with the chunk length, so the largest fitting length is found by
        bisection.
        """
        if num_wanted <= 0:
            return 0
        if not self.fits(shape.with_chunk(1, start_position + 1)):
            return 1 if shape.max_new_tokens <= 1 else 0
        lo, hi = 1, num_wanted
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(shape.with_chunk(mid, start_position + mid)):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_context_len(self) -> int | None:
        """The longest context a one-sequence, one-token step fits in memory (None: any)."""
        if self.memory is None:
            return None
        c0, c_seq, c_row, c_pair, c_ctx = self.memory.coefs
        left = self.memory_bytes - c0 - c_seq - c_row
        per_position = c_pair + c_ctx
        if left < 0:
            return 0
        return int(left // per_position) if per_position else None

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Feed one executed step to the time model (no-op without one)."""
        if self.time_model is not None:
            self.time_model.observe(self.priced(shape), seconds)

    def describe(self) -> str:
        """One line for the startup log."""
        parts = []
        if self.memory is not None:
            parts.append(f"activation memory budget {self.memory_bytes / 2**30:.2f} GiB")
            parts.append(f"max context {self.max_context_len()} tokens")
        if self.target_step_s is not None:
            parts.append(f"target step {self.target_step_s * 1000:.0f} ms")
        return ", ".join(parts) or "no memory or time bound"
