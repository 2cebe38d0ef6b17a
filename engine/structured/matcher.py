"""Per-request grammar state and the batch token bitmask.

One `RequestMatcher` per constrained request follows the committed tokens. Each step,
`BatchBitmask.fill` writes one row of allowed tokens per constrained request into an int32
bitmask on the host, and `apply_bitmask` sets the disallowed logits of those rows to −inf on
the logits' device before sampling. Unconstrained rows are neither filled nor touched.

Bitmask layout (`[rows, ceil(vocab / 32)]` int32, 1 = allowed):

    token t  ->  word t // 32, bit t % 32 (least significant bit first)
    row r:   | word 0: tokens 0..31 | word 1: tokens 32..63 | ... | last word: padded bits |
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from engine.structured.grammar import MarkerGuard, TokenBlock


class RequestMatcher:
    """The grammar state of one request, advanced on committed tokens.

    Not thread-safe; the engine step owns it. Rollback is unbounded (xgrammar keeps the history).
    """

    def __init__(
        self,
        grammar: xgr.CompiledGrammar,
        guard: MarkerGuard | None = None,
        block: TokenBlock | None = None,
    ) -> None:
        """guard, block: from `GrammarCompiler.guard_for(spec)` / `block_for(spec)`; applied
        after every bitmask fill (`CompiledConstraint.new_matcher` passes both)."""
        self._matcher = xgr.GrammarMatcher(grammar)
        self.vocab_size = grammar.tokenizer_info.vocab_size
        self.guard = guard
        self.block = block
        self.num_accepted = 0  # tokens accepted and not rolled back

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token (EOS): the request must finish."""
        return self._matcher.is_terminated()

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance on `token_ids` (one step may commit several). All or nothing.

        Returns True when every token was accepted. When one is rejected, the tokens of this call
        accepted before it are rolled back, the state is as before the call, and False is
        returned. Tokens after termination are rejected.
        """
        for num_accepted, token_id in enumerate(token_ids):
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                if num_accepted:
                    self._matcher.rollback(num_accepted)
                return False
        self.num_accepted += len(token_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. rejected speculative drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"num_tokens must be in [0, {self.num_accepted}], got {num_tokens}")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]` (host int32). Does not mutate state.

        Returns False when every token is allowed (the row needs no masking). A terminated
        matcher allows only its stop tokens (the request is finishing).
        """
        if self._matcher.is_terminated():
            _fill_only(bitmask, row, self._matcher.stop_token_ids)
            return True
        need_apply = self._matcher.fill_next_token_bitmask(bitmask, row)
        self.apply_guard(bitmask, row)
        if self.block is not None:
            self.block.apply(bitmask, torch.tensor([row]))
        return need_apply or self.guard is not None or self.block is not None

    def apply_guard(self, bitmask: torch.Tensor, row: int) -> None:
        """Apply this matcher's `MarkerGuard` (if any) to an already filled `bitmask[row]`."""
        guard = self.guard
        if guard is None:
            return
        word, bit = divmod(guard.marker_id, 32)
        if (int(bitmask[row, word]) >> bit) & 1:
            for keep_word, keep in guard.keep_words:
                bitmask[row, keep_word] &= keep

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        """The wrapped xgrammar matcher (for batched fills)."""
        return self._matcher


@dataclass(frozen=True)
class StepMask:
    """One step's bitmask: `bitmask` `[num_rows, ceil(vocab / 32)]` int32 on the host, of which
    only `rows` (the constrained rows, ascending) were filled and may be applied."""

    bitmask: torch.Tensor
    rows: list[int]


class BatchBitmask:
    """Fills the per-step bitmask of a batch, one row per sampling row.

    NOTE: a fresh (uninitialised) bitmask is allocated each step, so a mask being applied on
    the device for step N is never overwritten by the fill for step N+1. Unconstrained rows are
    left uninitialised and excluded from `rows`; they cost nothing.
    """

    def __init__(self, vocab_size: int, *, max_threads: int | str = "auto") -> None:
        self.vocab_size = vocab_size
        self.num_words = math.ceil(vocab_size / 32)
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads)

    def fill(self, matchers: Sequence[RequestMatcher | None]) -> StepMask | None:
        """The bitmask for a batch whose row i is constrained by `matchers[i]` (None: free).

        Returns None when no row is constrained.
        """
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return None
        bitmask = torch.empty((len(matchers), self.num_words), dtype=torch.int32)
        live = [row for row in rows if not matchers[row].is_terminated]
        if len(live) < 2:
            for row in rows:
                matchers[row].fill_bitmask(bitmask, row)
        else:
            for row in sorted(set(rows) - set(live)):
                matchers[row].fill_bitmask(bitmask, row)
            handles = [matchers[row].xgr_matcher for row in live]
            self._batch_matcher.batch_fill_next_token_bitmask(handles, bitmask, live)
            _apply_guards(bitmask, [(row, matchers[row].guard) for row in live])
            _apply_blocks(bitmask, [(row, matchers[row].block) for row in live])
        return StepMask(bitmask=bitmask, rows=rows)


def apply_bitmask(logits: torch.Tensor, mask: StepMask) -> None:
    """Set the disallowed logits of `mask.rows` to −inf, in place, on `logits.device`.

    logits: `[num_rows, vocab]` float, the same rows as the bitmask (vocab may include padding
    beyond the tokenizer's; it must equal the bitmask's vocab).
    Uses xgrammar's kernel for the device (CPU / Triton); `apply_bitmask_reference` is the spec.
    """
    _check_shapes(logits, mask)
    if not mask.rows:
        return
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=mask.rows)


def apply_bitmask_reference(logits: torch.Tensor, mask: StepMask) -> None:
    """Plain torch `apply_bitmask`: unpack the bits of each filled row and mask with −inf."""
    _check_shapes(logits, mask)
    vocab = logits.shape[-1]
    rows = torch.tensor(mask.rows, dtype=torch.long, device=logits.device)
    words = mask.bitmask.to(logits.device)[rows]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(len(mask.rows), words.shape[-1] * 32)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))


def unpack_bitmask_row(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """Bool `[vocab_size]`: which tokens `bitmask[row]` allows (for tests and debugging)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return (((bitmask[row].unsqueeze(-1) >> shifts) & 1).reshape(-1)[:vocab_size]).bool()


def _apply_guards(
    bitmask: torch.Tensor, guarded_rows: Sequence[tuple[int, MarkerGuard | None]]
) -> None:
    """`RequestMatcher.apply_guard` for many rows at once, one vectorised pass per guard."""
    rows_by_guard: dict[MarkerGuard, list[int]] = {}
    for row, guard in guarded_rows:
        if guard is not None:
            rows_by_guard.setdefault(guard, []).append(row)
    for guard, rows in rows_by_guard.items():
        word, bit = divmod(guard.marker_id, 32)
        index = torch.tensor(rows, dtype=torch.long)
        marker_allowed = ((bitmask[index, word] >> bit) & 1).bool()
        index = index[marker_allowed]
        for keep_word, keep in guard.keep_words:
            bitmask[index, keep_word] &= keep


def _apply_blocks(
    bitmask: torch.Tensor, blocked_rows: Sequence[tuple[int, TokenBlock | None]]
) -> None:
    """`TokenBlock.apply` for many rows at once, one pass per distinct block."""
    rows_by_block: dict[TokenBlock, list[int]] = {}
    for row, block in blocked_rows:
        if block is not None:
            rows_by_block.setdefault(block, []).append(row)
    for block, rows in rows_by_block.items():
        block.apply(bitmask, torch.tensor(rows, dtype=torch.long))


def _fill_only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Set `bitmask[row]` to allow exactly `token_ids`."""
    bitmask[row].zero_()
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def _check_shapes(logits: torch.Tensor, mask: StepMask) -> None:
    if logits.dim() != 2 or logits.shape[0] != mask.bitmask.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match bitmask {tuple(mask.bitmask.shape)}"
        )
    if math.ceil(logits.shape[1] / 32) != mask.bitmask.shape[1]:
        raise ValueError(
            f"logits vocab {logits.shape[1]} does not match bitmask width {mask.bitmask.shape[1]}"
        )
    if mask.bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {mask.bitmask.dtype}")
