"""GrammarTracker: the grammar side of the model runner.

It keeps one `RequestMatcher` per constrained request (created on the request's first sampled
token, kept across preemption, dropped by `release`), fills each step's bitmask and advances the
matchers on the sampled tokens. One step, as the runner drives it:

    pending = tracker.start_mask(infos)     # fill begins (on a worker thread when overlapping)
    ... model forward ...
    tracker.apply_mask(pending, logits)     # waits for the fill; −inf on disallowed tokens
    ... sample ...
    tracker.commit(infos, sampled_ids)      # matchers advance

A matcher's state depends only on the tokens committed before the step, so with `overlap` the
fill for step N+1 runs while step N+1's forward computes (xgrammar releases the GIL while it
fills). Below `MIN_OVERLAP_ROWS` constrained rows the fill (tens of µs) is done at once: handing
it to the worker would cost more than it hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.outputs import SamplingInfo
from engine.structured.matcher import BatchBitmask, RequestMatcher, StepMask, apply_bitmask

MIN_OVERLAP_ROWS = 8


class GrammarTracker:
    """Per-request matchers keyed by request id, and the step bitmask. Not thread-safe: the
    runner's step calls it from one thread (the fill itself may run on the tracker's worker)."""

    def __init__(self, vocab_size: int, *, overlap: bool = True) -> None:
        self._matchers: dict[str, RequestMatcher] = {}
        self._bitmask = BatchBitmask(vocab_size)
        self._pool = None
        if overlap:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    @property
    def num_matchers(self) -> int:
        """Requests whose grammar state is held (for tests and metrics)."""
        return len(self._matchers)

    def start_mask(
        self, request_ids: Sequence[str], infos: Sequence[SamplingInfo]
    ) -> Future[StepMask | None] | StepMask | None:
        """Begin filling the mask of one step's sampled rows (row i: `request_ids[i]`).

        Returns None when no row is constrained; otherwise a pending fill for `apply_mask`.
        Raises RuntimeError when a matcher has fallen behind its request's output.
        """
        matchers = [
            self._matcher_for(request_id, info)
            for request_id, info in zip(request_ids, infos, strict=True)
        ]
        num_constrained = sum(matcher is not None for matcher in matchers)
        if num_constrained == 0:
            return None
        if self._pool is None or num_constrained < MIN_OVERLAP_ROWS:
            return self._bitmask.fill(matchers)
        return self._pool.submit(self._bitmask.fill, matchers)

    def apply_mask(
        self, pending: Future[StepMask | None] | StepMask | None, logits: torch.Tensor
    ) -> None:
        """Wait for the fill begun by `start_mask` and mask `logits` (`[rows, vocab]`) in place."""
        if pending is None:
            return
        mask = pending.result() if isinstance(pending, Future) else pending
        if mask is not None:
            apply_bitmask(logits, mask)

    def commit(
        self, request_ids: Sequence[str], infos: Sequence[SamplingInfo], token_ids: Sequence[int]
    ) -> None:
        """Advance each constrained row's matcher on its sampled token.

        Raises RuntimeError if a sampled token breaks its grammar (the mask was not applied).
        """
        for request_id, info, token_id in zip(request_ids, infos, token_ids, strict=True):
            if info.constraint is None:
                continue
            if not self._matchers[request_id].accept([token_id]):
                raise RuntimeError(
                    f"request {request_id!r}: sampled token {token_id} is not allowed by its "
                    "grammar"
                )

    def draft_mask(
        self,
        request_ids: Sequence[str],
        infos: Sequence[SamplingInfo],
        drafts: Sequence[Sequence[int]],
    ) -> StepMask | None:
        """The bitmask of a speculative step's verify rows: request i owns `1 + len(drafts[i])`
        consecutive rows, row j masking the token after `drafts[i][:j]` (`dspark.md` §4.1).

        Each constrained matcher fills row 0 from its committed state, then walks the drafts:
        a draft its previous row allows is accepted and the next row filled; at the first
        draft it does not allow the walk stops (later rows stay unmasked: that draft has
        probability 0, so no later row is ever used). The walk is rolled back: matchers end as
        they began. None when no row is constrained.
        """
        offsets = [0]
        for tokens in drafts:
            offsets.append(offsets[-1] + 1 + len(tokens))
        rows: list[int] = []
        bitmask = torch.empty((offsets[-1], self._bitmask.num_words), dtype=torch.int32)
        rows_of = zip(request_ids, infos, drafts, offsets, strict=False)
        for request_id, info, tokens, first in rows_of:
            matcher = self._matcher_for(request_id, info)
            if matcher is None:
                continue
            matcher.fill_bitmask(bitmask, first)
            rows.append(first)
            walked = 0
            for j, token in enumerate(tokens):
                word, bit = divmod(token, 32)
                if not (int(bitmask[first + j, word]) >> bit) & 1 or not matcher.accept([token]):
                    break
                walked += 1
                matcher.fill_bitmask(bitmask, first + j + 1)
                rows.append(first + j + 1)
            matcher.rollback(walked)
        return StepMask(bitmask=bitmask, rows=rows) if rows else None

    def commit_tokens(
        self,
        request_ids: Sequence[str],
        infos: Sequence[SamplingInfo],
        token_lists: Sequence[Sequence[int]],
    ) -> None:
        """Advance each constrained row's matcher on the tokens its step committed, in order;
        tokens after the grammar terminated (its stop token) are not fed (the request ends there).

        Raises RuntimeError if a committed token breaks its grammar (a row was not masked).
        """
        for request_id, info, tokens in zip(request_ids, infos, token_lists, strict=True):
            if info.constraint is None:
                continue
            matcher = self._matchers[request_id]
            for token_id in tokens:
                if matcher.is_terminated:
                    break
                if not matcher.accept([token_id]):
                    raise RuntimeError(
                        f"request {request_id!r}: committed token {token_id} is not allowed by "
                        "its grammar"
                    )

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget finished requests (unknown ids are ignored)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _matcher_for(self, request_id: str, info: SamplingInfo) -> RequestMatcher | None:
        """The request's matcher, created at its first sampled token, positioned so that it has
        accepted exactly the request's `output_index` outputs."""
        if info.constraint is None:
            return None
        matcher = self._matchers.get(request_id)
        if matcher is None:  # (its vocabulary was checked by `AsyncEngine.generate`)
            matcher = self._matchers[request_id] = info.constraint.new_matcher()
        surplus = matcher.num_accepted - info.output_index
        if surplus < 0:
            raise RuntimeError(
                f"request {request_id!r}: its grammar matcher has seen {matcher.num_accepted} of "
                f"{info.output_index} output tokens"
            )
        matcher.rollback(surplus)  # tokens sampled ahead and not committed (speculation)
        return matcher
