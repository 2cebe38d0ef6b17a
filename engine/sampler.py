"""Batched, seeded, batch-invariant sampling on the device (CPU or CUDA).

One step's rows (one per request that samples this step) arrive as a fp32 `[rows, vocab]` logits
tensor plus a `SamplingBatch` built once from the rows' `SamplingInfo`s. `Sampler.sample` returns
the sampled ids and, when asked, logprobs, all still on the device: the caller brings them to the
host with one `.tolist()` each. Nothing in here syncs with the host per request; which code paths
run (penalties, top-k/top-p, min-p, logprobs) is decided from plain Python data at batch build time.
(One exception, on CPU only, where host and device are one: top-p reads which rows' nuclei are
wider than their `topk` candidates, `_candidate_cutoffs`. On CUDA those rows' cut-offs come from
the search kernel `kernels.nucleus_cutoff` instead, so no step reads back or sorts the vocabulary.)

Processing order (`process_logits`), each step per row:

    raw logits
      1. + logit bias            sparse (row, token, bias); also −inf on stop ids before min_tokens
      2. repetition penalty      tokens seen in prompt + output: x > 0 → x / r, else x · r
      3. frequency / presence    x −= count_in_output · frequency + (count_in_output > 0) · presence
      4. / temperature           greedy rows (temperature 0) divide by 1
      5. top-k                   keep x ≥ k-th largest value
      6. top-p                   keep the smallest best-first prefix with probability ≥ top_p
      7. min-p                   drop tokens with prob < min_p · max prob
      8. forced token            rows with `forced_token_id` (a spent thinking budget): every
                                 other token −inf, the forced one 0 (it is drawn, logprob 0)
    = processed logits (filtered tokens are −inf)

Then greedy rows take `argmax(processed)`, exactly, with no noise; sampled rows take
`argmax(processed + gumbel)`, which is exactly a draw from `softmax(processed)`, the filtered
distribution at the row's temperature.

Logprobs are `log_softmax(processed)`: after bias, penalties, temperature (1 for greedy rows) and
the filters, so filtered tokens have −inf. This is the "processed" choice (vLLM's
`logprobs_mode="processed_logprobs"`), i.e. the distribution the token was actually drawn from.

Randomness: the Gumbel noise of token `t` for a row is a pure function of
(request seed, absolute position, purpose, t), computed with integer tensor ops that give the same
bits on every device (see `noise_keys`, `counter_hash`). A seeded request therefore draws the same
tokens whatever else is in the batch, whichever row it occupies and however steps are cut.
"""

from __future__ import annotations

import array
import enum
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import chain, compress

import torch

import kernels
from engine.outputs import SamplingInfo
from engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from kernels.nucleus_cutoff import nucleus_cutoffs

# Temperatures in (0, 1e-5) sample as 1e-5: logits / T must stay finite; such rows are
# indistinguishable from greedy anyway.
MIN_TEMPERATURE = 1e-5


# ----------------------------------------------------------------------------------------------
# Counter-based random numbers
# ----------------------------------------------------------------------------------------------


class NoisePurpose(enum.IntEnum):
    """Independent random streams for one (seed, position). Each consumer gets its own member."""

    SAMPLE = 1  # the Gumbel noise of the ordinary next-token draw
    DRAFT = 2  # the Gumbel noise of a sampled speculative draft (`engine/speculative`)
    COIN = 3  # the uniform of a draft's rejection test
    RESIDUAL = 4  # the Gumbel noise of the residual draw after a rejection


_MASK32 = 0xFFFFFFFF


def _signed32(c: int) -> int:
    """A 32-bit constant as a signed value: for 0 ≤ x < 2^32, (x · c_signed) mod 2^32 equals
    (x · c) mod 2^32, and |x · c_signed| < 2^63 never overflows int64."""
    return c - (1 << 32) if c >= 1 << 31 else c


# lowbias32 (C. Wellons' hash-prospector, public domain): a bijection on 32-bit words.
_MIX_MUL_1 = _signed32(0x7FEB352D)
_MIX_MUL_2 = _signed32(0x846CA68B)
# Initial states of the two 32-bit key chains (any two distinct constants).
_KEY_INIT = (0x9E3779B9, 0x6A09E667)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on an int64 tensor whose values are in [0, 2^32).

    NOTE: every intermediate stays in [−2^63, 2^63): shifts act on non-negative values (so they
    are logical), products are < 2^32 · 2^31, and the mask keeps the low 32 bits of the two's
    complement. The result is therefore defined and identical on every device.
    """
    x.bitwise_xor_(x >> 16)
    x.mul_(_MIX_MUL_1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MIX_MUL_2).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16)
    return x


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """Per-row 64-bit keys `[rows, 2]` (two 32-bit words in int64) for `counter_hash`.

    seeds, positions: int64 `[rows]` (seeds as two's complement of seed mod 2^64).
    Two chains with different initial states absorb, in order, the purpose, the seed's low and
    high words and the position's low and high words, mixing after each word.
    """
    words = (
        seeds & _MASK32,
        (seeds >> 32) & _MASK32,
        positions & _MASK32,
        (positions >> 32) & _MASK32,
    )
    keys = torch.stack([torch.full_like(seeds, init ^ int(purpose)) for init in _KEY_INIT], dim=1)
    _mix32_(keys)
    for word in words:
        _mix32_(keys.bitwise_xor_(word[:, None]))
    return keys


def counter_hash(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """32-bit hashes `[rows, len(token_ids)]` (int64 in [0, 2^32)) of (row key, token id).

        h = lowbias32((key_a + token · (key_b | 1)) mod 2^32)

    Within a row the inputs are distinct (odd stride), so tokens get distinct hashes; two rows
    with different keys share only a handful of inputs (an odd-stride progression meets another in
    about len² / 2^32 points).
    """
    h = token_ids[None, :] * (keys[:, 1:] | 1)
    h.add_(keys[:, :1]).bitwise_and_(_MASK32)
    return _mix32_(h)


def gumbel_from_hash(h: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (fp32) from 32-bit hashes: −log(−log u), u = 1 − (h + ½) / 2^32.

    NOTE: computed as −log(−log1p(−v)) with v = (h + ½) / 2^32 so that the large-noise tail
    (u → 1, the tail that decides Gumbel-max draws) keeps full precision; v is clamped below 1.
    """
    v = h.to(torch.float32).add_(0.5).mul_(2.0**-32).clamp_(max=1.0 - 2.0**-24)
    return v.neg_().log1p_().neg_().log_().neg_()


# ----------------------------------------------------------------------------------------------
# The batch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSelection:
    """A subset of a batch's rows, known on the host (no device sync to use it).

    index: int64 row indices on the device; size: how many; is_all: the subset is every row, in
    order (then `take` returns its argument itself, not a copy).
    """

    index: torch.Tensor
    size: int
    is_all: bool

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The selected rows of `t` (a copy unless `is_all`)."""
        return t if self.is_all else t.index_select(0, self.index)

    def apply_(self, x: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
        """Run the in-place `fn` on the selected rows of `x` and write them back."""
        if self.size == 0:
            return
        rows = self.take(x)
        fn(rows)
        if not self.is_all:
            x.index_copy_(0, self.index, rows)

    def chunks(self, rows_per_chunk: int) -> Iterator[tuple[slice, slice | torch.Tensor]]:
        """(positions within the selection, batch rows) per chunk of the selection."""
        for start in range(0, self.size, rows_per_chunk):
            part = slice(start, min(start + rows_per_chunk, self.size))
            yield part, (part if self.is_all else self.index[part])


@dataclass(frozen=True)
class LogitBias:
    """Sparse additions to the raw logits: `logits[rows[i], tokens[i]] += values[i]`."""

    rows: torch.Tensor
    tokens: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class ForcedTokens:
    """Rows whose draw may produce one token only: `tokens[i]` for batch row `rows[i]`."""

    rows: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True)
class PenaltyEntries:
    """The logits a penalty can touch: one entry per history token of each penalised row
    (prompt tokens only for rows with a repetition penalty; duplicates kept).

    index: flat position `row * vocab + token` in the logits; rows: the batch row;
    output_counts: fp32, occurrences of that token among the row's output tokens.
    """

    index: torch.Tensor
    rows: torch.Tensor
    output_counts: torch.Tensor


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling parameters as device tensors, one row per sampled token.

    Per-row tensors (shape `[rows]`): temperature (the divisor: 1.0 for greedy rows, at least
    `MIN_TEMPERATURE` otherwise), top_p, top_k (int64, 0 = off; values ≥ vocab are stored as 0),
    min_p, presence/frequency/repetition penalties, seeds (int64, seed mod 2^64 as two's
    complement), positions (absolute position of the token being sampled: prompt length +
    output index), wants_logprobs (bool).
    num_logprobs: alternatives wanted per row (host); max_num_logprobs: their maximum.
    The selections, flags and `max_top_k` are host-side plans so that `Sampler` never syncs.
    """

    num_rows: int
    vocab_size: int
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    wants_logprobs: torch.Tensor
    num_logprobs: tuple[int, ...]
    max_num_logprobs: int
    logit_bias: LogitBias | None
    penalties: PenaltyEntries | None
    forced: ForcedTokens | None
    sample_rows: RowSelection  # temperature > 0: Gumbel draw
    greedy_rows: RowSelection  # temperature == 0: argmax
    filter_rows: RowSelection  # top-k or top-p active (greedy rows: only if logprobs wanted)
    min_p_rows: RowSelection  # min_p > 0 (greedy rows: likewise)
    logprob_rows: RowSelection  # logprobs wanted
    # filter rows by how the device finds their cut-off (CUDA; see `_apply_top_k_top_p`):
    kernel_rows: RowSelection  # top_p < 1 without top_k, or top_k above the candidates
    candidate_rows: RowSelection  # 0 < top_k <= NUCLEUS_CANDIDATES[-1]
    has_temperature: bool  # some row divides by a temperature other than 1
    uses_top_p: bool  # some filter row has top_p < 1
    uses_top_p_alone: bool  # some filter row has top_p < 1 and no top_k (the widest nuclei)
    max_top_k: int  # largest top_k among filter rows (0 if none)

    @classmethod
    def from_infos(
        cls,
        infos: Sequence[SamplingInfo],
        vocab_size: int,
        device: torch.device | str,
        *,
        eos_token_id: int | None = None,
        rows_cache: SamplingRowCache | None = None,
    ) -> SamplingBatch:
        """Build the batch for `infos` (row i samples for `infos[i]`) on `device`.

        eos_token_id: suppressed (with the row's `stop_token_ids`) while a row's output index is
        below `params.min_tokens`, unless the row has `ignore_eos` or a grammar constraint.
        rows_cache: what each `SamplingParams` object contributes to a row, kept from the
        previous call (the same requests decode step after step); None: derived afresh.
        Raises ValueError when a logit-bias or stop token id is outside the vocabulary or when a
        row with a penalty has no `history`. History token ids must be < vocab_size (not checked).
        """
        if rows_cache is None:
            rows_cache = SamplingRowCache()
        num_rows = len(infos)
        statics = rows_cache.rows([info.params for info in infos], vocab_size, eos_token_id)
        columns = list(zip(*(row.values for row in statics), strict=True)) or [()] * _NUM_COLUMNS
        (
            temperature,
            top_k,
            top_p,
            min_p,
            presence,
            frequency,
            repetition,
            wants_logprobs,
            num_logprobs,
            *flags,
        ) = columns
        is_sampled, is_greedy, is_filtered, is_min_p, is_kernel, is_candidate, is_penalised = flags
        bias_rows, bias_tokens, bias_values = _bias_entries(infos, statics, vocab_size)
        forced_rows = [i for i, info in enumerate(infos) if info.forced_token_id is not None]
        forced_tokens = [infos[i].forced_token_id for i in forced_rows]
        if any(not 0 <= t < vocab_size for t in forced_tokens):
            raise ValueError(f"a forced token id is outside the vocabulary ({vocab_size})")

        def where(flags: Sequence[bool]) -> list[int]:
            return list(compress(range(num_rows), flags))

        # on the device, top-p rows without a top_k the candidates can hold take the kernel
        selections = [
            where(f) for f in (is_sampled, is_greedy, is_filtered, is_min_p, wants_logprobs)
        ]
        selections += [where(is_kernel), where(is_candidate)]
        ints = _upload(
            [
                top_k,
                [_int64(info.seed) for info in infos],
                [info.num_prompt_tokens + info.output_index for info in infos],
                wants_logprobs,
                bias_rows,
                bias_tokens,
                forced_rows,
                forced_tokens,
                *selections,
            ],
            torch.int64,
            device,
        )
        floats = _upload(
            [temperature, top_p, min_p, presence, frequency, repetition, bias_values],
            torch.float32,
            device,
        )
        k_t, seeds_t, positions_t, wants_t, bias_rows_t, bias_tokens_t = ints[:6]
        forced_rows_t, forced_tokens_t = ints[6:8]
        sample, greedy, filtered, min_p_sel, logprob_sel, kernel_sel, candidate_sel = (
            RowSelection(index, len(sel), len(sel) == num_rows)
            for index, sel in zip(ints[8:], selections, strict=True)
        )
        temperature_t, top_p_t, min_p_t, presence_t, frequency_t, repetition_t, bias_t = floats
        filtered_k = list(compress(top_k, is_filtered))
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            temperature=temperature_t,
            top_p=top_p_t,
            top_k=k_t,
            min_p=min_p_t,
            presence_penalty=presence_t,
            frequency_penalty=frequency_t,
            repetition_penalty=repetition_t,
            seeds=seeds_t,
            positions=positions_t,
            wants_logprobs=wants_t.bool(),
            num_logprobs=tuple(num_logprobs),
            max_num_logprobs=max(num_logprobs, default=0),
            logit_bias=LogitBias(bias_rows_t, bias_tokens_t, bias_t) if bias_rows else None,
            penalties=_penalty_entries(infos, where(is_penalised), vocab_size, device),
            forced=ForcedTokens(forced_rows_t, forced_tokens_t) if forced_rows else None,
            sample_rows=sample,
            greedy_rows=greedy,
            filter_rows=filtered,
            min_p_rows=min_p_sel,
            logprob_rows=logprob_sel,
            kernel_rows=kernel_sel,
            candidate_rows=candidate_sel,
            has_temperature=any(t != 1.0 for t in temperature),
            uses_top_p=any(p < 1 for p in compress(top_p, is_filtered)),
            uses_top_p_alone=0 in filtered_k,
            max_top_k=max(filtered_k, default=0),
        )


_NUM_COLUMNS = 16  # the entries of `_RowStatics.values`


@dataclass(frozen=True)
class _RowStatics:
    """What one `SamplingParams` contributes to a batch row, whatever the step.

    values: (temperature divisor, top_k (0 = off), top_p, min_p, presence, frequency,
    repetition, wants logprobs (0/1), alternatives, then the flags: sampled, greedy, filtered
    (top-k or top-p active), min-p, kernel cut-off, candidate cut-off, penalised).
    bias: the logit bias with −inf on banned ids (token → value, in the order applied);
    stops: the ids banned while the output index is below `min_tokens` (with EOS unless
    `ignore_eos`), validated against the vocabulary only when used."""

    values: tuple
    bias: dict[int, float]
    stops: tuple[int, ...]


def _row_statics(params: SamplingParams, vocab_size: int, eos_token_id: int | None) -> _RowStatics:
    greedy = params.is_greedy
    temperature = 1.0 if greedy else max(params.temperature, MIN_TEMPERATURE)
    top_k = params.top_k if params.top_k < vocab_size else 0
    # NOTE: the filters never change an argmax, so greedy rows skip them unless they want
    # logprobs (which are taken from the filtered distribution).
    needs_filters = not greedy or params.logprobs
    filtered = bool((top_k > 0 or params.top_p < 1) and needs_filters)
    kernel = filtered and ((top_k == 0 and params.top_p < 1) or top_k > NUCLEUS_CANDIDATES[-1])
    candidate = filtered and 0 < top_k <= NUCLEUS_CANDIDATES[-1]
    penalised = (
        params.repetition_penalty != 1
        or params.frequency_penalty != 0
        or params.presence_penalty != 0
    )
    bias = dict(params.logit_bias)
    bias.update(dict.fromkeys(params.banned_token_ids, -math.inf))
    for token in bias:
        if not 0 <= token < vocab_size:
            raise ValueError(f"token id {token} is outside the vocabulary ({vocab_size})")
    stops = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stops.add(eos_token_id)
    values = (
        temperature,
        top_k,
        params.top_p,
        params.min_p,
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
        int(params.logprobs),
        params.num_logprobs,
        not greedy,
        greedy,
        filtered,
        bool(params.min_p > 0 and needs_filters),
        bool(kernel),
        bool(candidate),
        penalised,
    )
    return _RowStatics(values, bias, tuple(stops) if params.min_tokens else ())


class SamplingRowCache:
    """`_RowStatics` by `SamplingParams` object, kept from one batch to the next.

    Holds the params objects of the latest batch only (so their ids cannot be reused while
    cached) and forgets the rest; a different vocabulary or EOS id starts afresh. One per
    runner; not thread-safe."""

    def __init__(self) -> None:
        self._key: tuple[int, int | None] | None = None
        self._rows: dict[int, tuple[SamplingParams, _RowStatics]] = {}

    def rows(
        self, params: Sequence[SamplingParams], vocab_size: int, eos_token_id: int | None
    ) -> list[_RowStatics]:
        """The statics of each row's params; mutates the cache to hold exactly these."""
        if self._key != (vocab_size, eos_token_id):
            self._key = (vocab_size, eos_token_id)
            self._rows = {}
        old, new = self._rows, {}
        out = []
        for p in params:
            key = id(p)
            entry = new.get(key) or old.get(key)
            if entry is None or entry[0] is not p:
                entry = (p, _row_statics(p, vocab_size, eos_token_id))
            new[key] = entry
            out.append(entry[1])
        self._rows = new
        return out


def _int64(value: int) -> int:
    """value mod 2^64 as a signed int64."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _upload(parts: list[list], dtype: torch.dtype, device: torch.device | str) -> list:
    """Lists → one host tensor → one copy to `device` → a view per list."""
    flat = _to_device(torch.tensor(list(chain.from_iterable(parts)), dtype=dtype), device)
    return list(flat.split([len(p) for p in parts]))


def _to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host tensor to `device` without waiting for the device's queued work.

    NOTE: a plain `.to("cuda")` from pageable memory synchronises the stream; from pinned memory
    with non_blocking=True it does not, and the caching host allocator keeps the pinned buffer
    alive until the copy has run.
    """
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _bias_entries(
    infos: Sequence[SamplingInfo], statics: Sequence[_RowStatics], vocab_size: int
) -> tuple[list[int], list[int], list[float]]:
    """(rows, tokens, values) of the logit bias, with −inf on banned ids and on stop ids before
    min_tokens (except on grammar-constrained rows: their grammar decides when they may end)."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for row, (info, static) in enumerate(zip(infos, statics, strict=True)):
        entries = static.bias
        if static.stops and info.output_index < info.params.min_tokens and info.constraint is None:
            entries = dict(entries)
            entries.update(dict.fromkeys(static.stops, -math.inf))
            for token in static.stops:
                if not 0 <= token < vocab_size:
                    raise ValueError(f"token id {token} is outside the vocabulary ({vocab_size})")
        if entries:
            rows.extend([row] * len(entries))
            tokens.extend(entries)
            values.extend(entries.values())
    return rows, tokens, values


def _penalty_entries(
    infos: Sequence[SamplingInfo], rows: list[int], vocab_size: int, device: torch.device | str
) -> PenaltyEntries | None:
    """Entries of the penalised `rows`, built on the host with vectorised ops (output counts by
    sorting the output keys: no `[rows, vocab]` scratch tensor), then copied to `device`."""
    if not rows:
        return None
    if any(infos[row].history is None for row in rows):
        raise ValueError("a row with a penalty needs its token history")
    histories, num_prompt = [], []
    for row in rows:
        info = infos[row]
        start = 0 if info.params.repetition_penalty != 1 else info.num_prompt_tokens
        histories.append(info.history[start:])
        num_prompt.append(info.num_prompt_tokens - start)
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.int64)
    total = int(lengths.sum())
    if total == 0:
        return None  # nothing generated yet and no repetition penalty: no logit changes
    owner = torch.tensor(rows, dtype=torch.int64).repeat_interleave(lengths, output_size=total)
    starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths, output_size=total)
    prompt_len = torch.tensor(num_prompt, dtype=torch.int64).repeat_interleave(lengths)
    is_output = torch.arange(total) - starts >= prompt_len
    tokens = torch.frombuffer(array.array("q", chain.from_iterable(histories)), dtype=torch.int64)
    index = owner * vocab_size + tokens
    keys, key_counts = torch.unique(index[is_output], return_counts=True)  # sorted
    counts = torch.zeros(total, dtype=torch.float32)
    if keys.numel():
        at = torch.searchsorted(keys, index).clamp_(max=keys.numel() - 1)
        counts = torch.where(keys[at] == index, key_counts[at].to(torch.float32), counts)
    return PenaltyEntries(
        _to_device(index, device), _to_device(owner, device), _to_device(counts, device)
    )


# ----------------------------------------------------------------------------------------------
# Processing
# ----------------------------------------------------------------------------------------------


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The processed logits `[rows, vocab]` fp32 (see the module docstring for the order).

    Does not modify `logits`. Filtered-out tokens are −inf; the best token always survives.
    Greedy rows that want no logprobs skip top-k/top-p/min-p (their argmax is the same).
    """
    if logits.shape != (batch.num_rows, batch.vocab_size):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match the batch "
            f"({batch.num_rows}, {batch.vocab_size})"
        )
    x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    # NOTE: every later step works in place on this contiguous copy.
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        x.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)
    _apply_penalties(x, batch)
    if batch.has_temperature:
        x.div_(batch.temperature[:, None])
    _apply_top_k_top_p(x, batch)
    _apply_min_p(x, batch)
    _apply_forced(x, batch)
    return x


def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition, then frequency and presence, at the history entries only (no dense pass)."""
    entries = batch.penalties
    if entries is None:
        return
    flat = x.view(-1)
    values = flat[entries.index]
    r = batch.repetition_penalty[entries.rows]
    values = torch.where(values > 0, values / r, values * r)  # r == 1: unchanged, exactly
    counts = entries.output_counts
    values -= counts * batch.frequency_penalty[entries.rows]
    values -= (counts > 0).to(torch.float32) * batch.presence_penalty[entries.rows]
    flat[entries.index] = values  # NOTE: duplicate entries carry identical values


def _apply_top_k_top_p(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Top-k, then top-p on the renormalised top-k survivors, as one threshold per row.

    Without top-p rows a `topk(max_top_k)` gives each row's k-th value (on CUDA past the last
    candidate count, the search kernel's exact count search). With them, on the CPU
    the cut-offs come from `topk` candidates (`_candidate_cutoffs`, reading on the host which
    rows need wider ones) and from the sorted rule (`sorted_top_k_top_p_cutoffs`) for rows
    wider still. On CUDA (and in Triton's interpreter) nothing is read back and nothing sorts
    the vocabulary: rows with 0 < top_k <= the last candidate count take the candidates (bit
    for bit the sorted rule), the others (`batch.kernel_rows`: top-p without top_k, or a larger
    top_k) the search kernel `kernels.nucleus_cutoff` (the same rule, its masses summed in a
    fixed order: fp32 within a tile, float64 across; equal kept sets except where the mass at
    the cut-off is within `kernels.nucleus_cutoff.MASS_TOLERANCE` of top_p). Which rows take
    which depends only on each row's parameters, so a row's kept set does not depend on the
    batch. Ties with the cut-off are kept.
    """
    sel = batch.filter_rows
    if sel.size == 0:
        return
    device_path = kernels.runs_kernels(x)
    if not batch.uses_top_p:
        k = sel.take(batch.top_k)[:, None]
        # NOTE: `topk` sorts what it returns; past the candidates the search's count is cheaper
        # (the k-th value is exact either way)
        by_search = device_path and batch.max_top_k > NUCLEUS_CANDIDATES[-1]

        def top_k_only(xs: torch.Tensor) -> None:
            if by_search:
                cutoff = nucleus_cutoffs(xs, k, torch.ones(len(xs), device=xs.device))
            else:
                cutoff = xs.topk(batch.max_top_k, dim=-1).values.gather(1, k - 1)
            xs.masked_fill_(xs < cutoff, -math.inf)

        sel.apply_(x, top_k_only)
        return
    if device_path:
        _device_top_k_top_p(x, batch)
        return
    rows = _NucleusRows(
        sel.take(batch.top_k)[:, None],
        sel.take(batch.top_p)[:, None],
        batch.max_top_k > 0,
        batch.uses_top_p_alone,
    )
    num_candidates = max(NUCLEUS_CANDIDATES[0], batch.max_top_k)
    use_candidates = num_candidates <= NUCLEUS_CANDIDATES[-1] and num_candidates < batch.vocab_size

    def top_k_top_p(xs: torch.Tensor) -> None:
        if use_candidates:
            cutoff = _candidate_cutoffs(xs, rows, num_candidates)
        else:
            cutoff = _sorted_cutoffs(xs, rows)
        xs.masked_fill_(xs < cutoff, -math.inf)

    sel.apply_(x, top_k_top_p)


def _device_top_k_top_p(x: torch.Tensor, batch: SamplingBatch) -> None:
    """`_apply_top_k_top_p` without a host read or a sort: candidates for the rows whose top_k
    they hold, the search kernel for the others."""
    by_kernel, by_candidates = batch.kernel_rows, batch.candidate_rows

    def search(xs: torch.Tensor) -> None:
        top_k, top_p = by_kernel.take(batch.top_k), by_kernel.take(batch.top_p)
        xs.masked_fill_(xs < nucleus_cutoffs(xs, top_k, top_p), -math.inf)

    by_kernel.apply_(x, search)
    # NOTE: candidates at the whole row (c = vocab) are the sorted rule itself; with no top-p-
    # alone row `_candidate_cutoffs` reads nothing back.
    num_candidates = min(
        max(NUCLEUS_CANDIDATES[0], min(batch.max_top_k, NUCLEUS_CANDIDATES[-1])), batch.vocab_size
    )
    rows = _NucleusRows(
        by_candidates.take(batch.top_k)[:, None],
        by_candidates.take(batch.top_p)[:, None],
        True,
        False,
    )

    def candidates(xs: torch.Tensor) -> None:
        xs.masked_fill_(xs < _candidate_cutoffs(xs, rows, num_candidates), -math.inf)

    by_candidates.apply_(x, candidates)


# `topk` candidates per top-p row, tried in turn (the first at least the batch's largest top_k):
# most nuclei fit in the first; on CPU a top-p-alone row whose nucleus does not fit in the last
# takes the sort, and a batch with a top_k above the last sorts (`topk` would cost about as
# much). On CUDA only rows with 0 < top_k <= the last take candidates (`_device_top_k_top_p`).
NUCLEUS_CANDIDATES = (256, 4096)
# Candidates whose cumulative mass is below top_p + this (8 float ulps at 1) may not hold the
# whole nucleus: the sorted rule's `before` of a later token can round one ulp below its mass.
_MASS_MARGIN = 2.0**-20


@dataclass(frozen=True)
class _NucleusRows:
    """The filter rows of a step with top-p: `top_k` (int64, 0 = off) and `top_p` `[n, 1]`;
    any_top_k / any_vocab: some row has top_k > 0 / top_k == 0 (host flags: which
    normalisers to compute); vocab_exps: exp(x − max) `[n, vocab]` in vocabulary order and
    their sums `[n, 1]` (the normaliser without top_k), once computed."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    any_top_k: bool
    any_vocab: bool
    vocab_exps: tuple[torch.Tensor, torch.Tensor] | None = None

    def with_vocab_exps(self, xs: torch.Tensor) -> _NucleusRows:
        if not self.any_vocab or self.vocab_exps is not None:
            return self
        exps = (xs - xs.amax(dim=-1, keepdim=True)).exp_()
        return replace(self, vocab_exps=(exps, exps.sum(dim=-1, keepdim=True)))

    def top_p_alone(self, index: torch.Tensor) -> _NucleusRows:
        """The rows `index`, all without top_k."""
        exps = None if self.vocab_exps is None else tuple(t[index] for t in self.vocab_exps)
        return _NucleusRows(self.top_k[index], self.top_p[index], False, True, exps)


def sorted_top_k_top_p_cutoffs(
    xs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The reference rule: each row's cut-off value `[n, 1]`; a row keeps `xs >= cutoff`.

    xs: fp32 `[n, vocab]`; top_k: int64 `[n, 1]` (0 = off); top_p: fp32 `[n, 1]` in (0, 1].
    One descending sort; the best-first prefix keeps a token while the probability of the
    better tokens (renormalised over the top k) is below top_p; the cut-off is the last kept
    value. The probabilities of a row with top_k are the softmax of its top k sorted values;
    of a row without, exp(x − max) over their sum taken in vocabulary order (so that
    `_candidate_cutoffs` reproduces them bit for bit without the sort; torch's CPU softmax of a
    whole 129K row is off by ~1e-5, this sum by ~1e-8).
    """
    return _sorted_cutoffs(xs, _NucleusRows(top_k, top_p, True, True))


def _sorted_cutoffs(xs: torch.Tensor, rows: _NucleusRows) -> torch.Tensor:
    best = xs.sort(dim=-1, descending=True)
    return _nucleus_cutoffs(xs, best, rows.with_vocab_exps(xs))[0]


def _candidate_cutoffs(xs: torch.Tensor, rows: _NucleusRows, num_candidates: int) -> torch.Tensor:
    """`sorted_top_k_top_p_cutoffs` without the sort, bit for bit: the rule runs on the best
    `num_candidates` values of each row (`topk`: the sorted row's first columns, same bits).
    A top-p-alone row whose candidates hold less than top_p takes the next count of
    `NUCLEUS_CANDIDATES` if that many could reach top_p (each further token has at most the
    last candidate's probability), else the sorted rule.

    NOTE: the host reads which rows those are (free on CPU; callers on CUDA pass only rows with
    0 < top_k <= num_candidates, which never need it).
    """
    rows = rows.with_vocab_exps(xs)
    cutoff, mass, last = _nucleus_cutoffs(xs, xs.topk(num_candidates, dim=-1), rows)
    if not rows.any_vocab:
        return cutoff
    wider = (rows.top_k == 0) & (mass < rows.top_p + _MASS_MARGIN)
    more = [n for n in NUCLEUS_CANDIDATES if num_candidates < n < xs.shape[1]]
    if more:
        reachable = mass + (more[0] - num_candidates) * last >= rows.top_p
        plans = [(wider & reachable, more[0]), (wider & ~reachable, None)]
    else:
        plans = [(wider, None)]
    for selected, count in plans:
        index = selected.squeeze(1).nonzero().squeeze(1)
        if index.numel() == 0:
            continue
        part = rows.top_p_alone(index)
        sub = xs if index.numel() == len(xs) else xs[index]
        if count is None:
            cutoff[index] = _sorted_cutoffs(sub, part)
        else:
            cutoff[index] = _candidate_cutoffs(sub, part, count)
    return cutoff


def _nucleus_cutoffs(
    xs: torch.Tensor, best: tuple[torch.Tensor, torch.Tensor], rows: _NucleusRows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cut-off, cumulative probability of all of `best`, probability of its last), each
    `[n, 1]`, from `best`: the (values, token ids) `[n, c]` of each row's first c columns sorted
    descending (c = vocab: the whole row).

    NOTE: each probability is computed by the same op on the same input whatever c is (the
    top-k softmax over a vocabulary-wide row padded with −inf; the exponentials of the row in
    vocabulary order, gathered at the token ids, over their sum), and the cumulative sum's
    prefix does not depend on c, so the candidates' cut-off equals the sorted rule's whenever
    the nucleus ends inside them.
    """
    values, token_ids = best
    vocab, num = xs.shape[1], values.shape[1]
    k = rows.top_k
    in_top_k = torch.arange(num, device=xs.device) < torch.where(k > 0, k, vocab)
    # NOTE: a CPU scan runs left to right (in float64), so its prefix does not depend on the
    # row's length; a CUDA scan cuts rows into chunks sized by the length, so there the top-k
    # probabilities are scanned over the whole padded row.
    scan_padded = xs.is_cuda and not rows.any_vocab
    probs = None
    if rows.any_top_k:
        padded = values.masked_fill(~in_top_k, -math.inf)
        if num < vocab:
            padded = torch.cat([padded, padded.new_full((len(xs), vocab - num), -math.inf)], 1)
        probs = padded.softmax(dim=-1)
        if not scan_padded:
            probs = probs[:, :num]
    if rows.any_vocab:
        exps, sums = rows.vocab_exps
        vocab_probs = exps.gather(1, token_ids).div_(sums)
        probs = vocab_probs if probs is None else torch.where(k > 0, probs, vocab_probs)
    mass = probs.cumsum(dim=-1)[:, :num]
    probs = probs[:, :num]
    before = mass - probs  # probability of the better tokens
    top_p = rows.top_p
    keep = in_top_k & ((before < top_p) | (top_p >= 1))
    cutoff = values.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    return cutoff, mass[:, -1:], probs[:, -1:]


def _apply_min_p(x: torch.Tensor, batch: SamplingBatch) -> None:
    """prob < min_p · max prob  ⇔  x < max x + log(min_p) (the normaliser cancels)."""
    sel = batch.min_p_rows

    def drop(xs: torch.Tensor) -> None:
        floor = xs.amax(dim=-1, keepdim=True) + sel.take(batch.min_p)[:, None].log()
        xs.masked_fill_(xs < floor, -math.inf)

    sel.apply_(x, drop)


def _apply_forced(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Forced rows keep one token (value 0, so both the argmax and the Gumbel draw take it)."""
    forced = batch.forced
    if forced is None:
        return
    x.index_fill_(0, forced.rows, -math.inf)
    x.index_put_((forced.rows, forced.tokens), torch.zeros_like(forced.tokens, dtype=x.dtype))


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerOutput:
    """Device tensors of one step.

    token_ids: int64 `[rows]`. logprobs: fp32 `[rows]`, the sampled token's logprob (NaN for rows
    that did not ask). top_ids / top_logprobs: `[rows, max_num_logprobs]` best first (id −1 and
    NaN for rows that did not ask); a row wanting k alternatives reads the first k. Alternatives
    filtered out by top-k/top-p/min-p carry −inf. None when no row asked.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


class Sampler:
    """Stateless: `sample(logits, batch)` for every step.

    noise_chunk_elements: the Gumbel noise of sampled rows is made and consumed in chunks of about
    this many elements (on CPU a chunk that fits in cache is much faster; on CUDA it bounds the
    temporary memory).
    """

    def __init__(self, noise_chunk_elements: int | None = None) -> None:
        self.noise_chunk_elements = noise_chunk_elements

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of `logits` (`[rows, vocab]`, fp32) under `batch`."""
        x = process_logits(logits, batch)
        token_ids = self._draw(x, batch)
        return _logprobs(x, token_ids, batch)

    def draw(self, processed: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The token `sample` would draw for each row of already `process_logits`-ed logits."""
        return self._draw(processed, batch)

    def logprobs_of(
        self, processed: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
    ) -> SamplerOutput:
        """`sample`'s output for given `token_ids` (speculation: the committed tokens)."""
        return _logprobs(processed, token_ids, batch)

    def _draw(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """argmax for greedy rows, argmax(x + Gumbel(seed, position, token)) for the others."""
        if batch.greedy_rows.size:
            token_ids = x.argmax(dim=-1)
        else:
            token_ids = torch.empty(batch.num_rows, dtype=torch.int64, device=x.device)
        sel = batch.sample_rows
        if sel.size == 0:
            return token_ids
        keys = noise_keys(sel.take(batch.seeds), sel.take(batch.positions), NoisePurpose.SAMPLE)
        vocab_ids = torch.arange(batch.vocab_size, device=x.device)
        for part, rows in sel.chunks(self._rows_per_chunk(x)):
            noise = gumbel_from_hash(counter_hash(keys[part], vocab_ids))
            token_ids[rows] = noise.add_(x[rows]).argmax(dim=-1)
        return token_ids

    def _rows_per_chunk(self, x: torch.Tensor) -> int:
        elements = self.noise_chunk_elements
        if elements is None:
            elements = 1 << 25 if x.is_cuda else 1 << 18
        return max(1, elements // x.shape[1])


def _logprobs(x: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """log_softmax of the processed logits at the sampled ids and the best alternatives."""
    sel = batch.logprob_rows
    if sel.size == 0:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = sel.take(x).log_softmax(dim=-1)
    chosen = logprobs.gather(1, sel.take(token_ids)[:, None]).squeeze(1)
    k = min(batch.max_num_logprobs, MAX_TOP_LOGPROBS, batch.vocab_size)
    top_lps, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    if sel.is_all:
        return SamplerOutput(token_ids, chosen, top_ids, top_lps)
    n = batch.num_rows
    return SamplerOutput(
        token_ids,
        _expand_rows(chosen, sel, n, math.nan),
        None if top_ids is None else _expand_rows(top_ids, sel, n, -1),
        None if top_lps is None else _expand_rows(top_lps, sel, n, math.nan),
    )


def _expand_rows(
    values: torch.Tensor, sel: RowSelection, num_rows: int, fill: float
) -> torch.Tensor:
    """`values` of the selected rows placed in a `[num_rows, ...]` tensor filled with `fill`."""
    out = values.new_full((num_rows, *values.shape[1:]), fill)
    return out.index_copy_(0, sel.index, values)
