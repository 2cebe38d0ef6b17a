"""Continuous-batching scheduler: queues, token budget, chunked prefill, preemption (no torch).

One engine step is `out = schedule(); model = runner.execute(out); deltas = update(out, model)`.
The scheduler works on ints, block ids and `Request` objects and emits plain data
(`engine/outputs.py`); it never sees a tensor.

Counting rule: a request's `num_computed_tokens` catches up with its tokens (prompt + output).
The positions `[num_computed_tokens, num_tokens)` are what a step may compute; a request is
decoding when only its last sampled token is left. A chunk that reaches `num_tokens` also samples
the next token.

    prompt + output   t0 t1 t2 t3 t4 t5 t6 | t7            (t7: last sampled, not yet cached)
    computed          ^^^^^^^^^^^^^^^^^^^^                   num_computed_tokens = 7
    next chunk                               [t7] -> sample t8 at position 8

Each step, in this order, while the token budget lasts:
  1. decode rows of running requests (1 position each);
  2. the next chunk of running requests still in prefill (or recompute);
  3. WAITING requests, in (priority, arrival) order, while `max_num_seqs`, free slots and free
     blocks allow; admission stops at the first request that does not fit (no overtaking, so a
     large request is not starved). Skipped in a step that preempted (memory is tight).
     A request waiting for KV from a directory tier (`PrefixReuse.is_ready`) is passed over
     until its blocks are loaded or its deadline passes.
Running requests are visited best first, by the same (priority, arrival) order.

Memory. Admission reserves blocks for every known token of the request (prompt + outputs so far)
so that a prefill never stalls midway; a running request only grows by one block every
`block_tokens` decoded tokens. When that growth finds no free block, the scheduler preempts by
recompute: the worst running request (largest priority value, then latest arrival) loses its
blocks and slot, keeps its output tokens, gets `num_computed_tokens = 0` and goes back to
WAITING, where its original (priority, arrival) key puts it ahead of every later arrival of its
priority. It is re-admitted like any waiting request and recomputes prompt + outputs; since the
engine keys randomness by (seed, position), it then samples exactly the tokens it would have
sampled without preemption. The victim is never better than the request that needs the block
(possibly it is that request itself), so the best running request always makes progress.

Chunk lengths. Besides the token budget, each chunk is bounded by the `StepBudget`
(`engine/step_budget.py`): the step's estimated activation memory and predicted time, both
functions of its padded shape, stay within the memory budget and the target step time. A long
prefill therefore advances in chunks that each take about the target time, and an abort takes
effect at the next chunk boundary.

Async scheduling. `schedule()` may be called again before the previous output's `update()`:
every chunk handed out is counted in `Request.num_inflight_tokens` (and its sampled token in
`num_output_placeholders`) until `update` applies it, and the next chunk starts after it. A
decode row whose last token is still being sampled carries `PLACEHOLDER_TOKEN_ID`, which the
runner fills on the device. A request is not scheduled past a length limit its placeholders
already reach; EOS and stop ids are only seen by `update`, so a request that stopped may have
one more chunk in flight, whose token `update` ignores (never emitted). In the synchronous loop
both counts are 0 whenever `schedule()` runs.

Requests that can never run (empty prompt, prompt + max_tokens > max_model_len, more blocks than
the whole pool, a context whose one-token step exceeds the memory budget) are rejected in
`add_request`: finished at once with `FinishReason.ABORT` and an `error`. They, and aborted
requests, surface as Deltas through `update` (see its docstring).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_cache import KVCacheManager
from engine.kv_cache.reuse import PrefixReuse
from engine.limits import RequestLimits
from engine.outputs import (
    PLACEHOLDER_TOKEN_ID,
    Delta,
    ModelOutput,
    SamplingInfo,
    ScheduledChunk,
    SchedulerOutput,
)
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.speculative.planner import BudgetDecision
from engine.step_budget import StepBudget, StepShape, num_leading_rows

if TYPE_CHECKING:
    from engine.speculative.scheduling import DraftScheduling


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Scheduling limits.

    max_model_len: the context limit (prompt + output tokens of one request).
    max_num_batched_tokens: positions computed per step, all requests together (the budget).
    max_num_seqs: running requests at most.
    NOTE: `max_num_batched_tokens >= max_num_seqs`, so every decode row fits in every step.
    """

    max_model_len: int
    max_num_batched_tokens: int = 32768
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise ValueError(
                "SchedulerConfig.max_model_len must be >= 2 (a prompt token and a generated one)"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_num_seqs ({self.max_num_seqs}) so that every decode row fits in a step"
            )


class _StepPlan:
    """Positions chosen so far in one `schedule()` call; insertion order is batch order.

    The padded shape is kept as running maxima (O(1) per chunk); a `drop` (preemption) marks
    them stale and the next `shape()` recomputes them."""

    def __init__(self, budget: int, step_budget: StepBudget) -> None:
        self.budget_left = budget
        self.step_budget = step_budget
        self.num_new_tokens: dict[str, int] = {}
        self.num_draft_slots: dict[str, int] = {}  # speculation: decode rows' draft caps
        self.end_positions: dict[str, int] = {}
        self.num_preempted = 0
        self._max_new_tokens = 0
        self._max_end = 0
        self._num_leading = 0  # leading one-token chunks (`StepShape.num_apart`)
        self._is_stale = False

    def chunk_len(self, request: Request, start: int | None = None) -> int:
        """Positions the request's next chunk may take: what is left, within the token budget
        and the step budget (memory, time); 0 only when the token budget is spent. start: where
        the chunk starts (default: after the positions computed or in flight; a prefix hit's
        replay)."""
        start = request.num_scheduled_tokens if start is None else start
        wanted = min(request.num_tokens_with_placeholders - start, self.budget_left)
        return self.step_budget.max_chunk(self.shape(), start, wanted)

    def shape(self) -> StepShape:
        if self._is_stale:
            lengths = list(self.num_new_tokens.values())
            self._max_new_tokens = max(lengths, default=0)
            self._max_end = max(self.end_positions.values(), default=0)
            self._num_leading = num_leading_rows(lengths)
            self._is_stale = False
        return StepShape(
            len(self.num_new_tokens), self._max_new_tokens, self._max_end, self._num_leading
        )

    def add(self, request: Request, num_tokens: int, num_draft_slots: int = 0) -> None:
        rid = request.request_id
        end = request.num_computed_tokens + request.num_inflight_tokens + num_tokens
        if num_tokens == 1 and self._num_leading == len(self.num_new_tokens):
            self._num_leading += 1
        self.num_new_tokens[rid] = num_tokens
        self.end_positions[rid] = end
        self.budget_left -= num_tokens + num_draft_slots
        if num_tokens > self._max_new_tokens:
            self._max_new_tokens = num_tokens
        if end > self._max_end:
            self._max_end = end
        if num_draft_slots:
            self.num_draft_slots[rid] = num_draft_slots

    def drop(self, request_id: str) -> None:
        self.end_positions.pop(request_id, None)
        self.budget_left += self.num_new_tokens.pop(request_id, 0)
        self.budget_left += self.num_draft_slots.pop(request_id, 0)
        self._is_stale = True


class Scheduler:
    """Owns the waiting and running queues; decides each step's batch; applies its results.

    `update()` applies `schedule()` outputs in order: it advances `num_computed_tokens` by what
    the matching output computed. Synchronous engines alternate the two; an async engine
    schedules one step ahead (see the module docstring). `add_request` and `abort` may be
    called between any two calls. Not thread-safe: the engine calls it from one thread.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        step_budget: StepBudget | None = None,
        *,
        prefix_reuse: PrefixReuse | None = None,
        speculation: DraftScheduling | None = None,
    ) -> None:
        """step_budget: bounds each chunk by activation memory and step time (default: the
        token budget alone). prefix_reuse: the prefix-cache collaborator (None: no caching);
        it matches waiting requests at admission and indexes blocks as they fill
        (`engine/kv_cache/reuse.py`). speculation: draft caps and the step's draft budget
        (`engine/speculative/scheduling.py`; None: one token per decode row). Under async
        scheduling its rows scheduled behind a step in flight need `resolve` before they run."""
        self.config = config
        self.kv_manager = kv_manager
        self.step_budget = step_budget or StepBudget()
        self.prefix_reuse = prefix_reuse
        self.speculation = speculation
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._waiting: list[Request] = []  # sorted by _order_key
        self._running: list[Request] = []  # sorted by _order_key (best first)
        self._arrival_order: dict[str, int] = {}  # tie-break for equal (priority, arrival_time)
        self._num_added = 0
        self._outbox: list[Delta] = []  # final Deltas of rejected / aborted requests
        self._finished_ids: list[str] = []  # finished since the last schedule()
        self._num_preemptions = 0

    # ---------------------------------------------------------------- queries

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since construction, all requests together (a metrics counter)."""
        return self._num_preemptions

    def has_unfinished_requests(self) -> bool:
        """True while a request waits or runs, or a final Delta awaits the next `update`.

        NOTE: a request counts as unfinished for the engine until its final Delta is emitted,
        so a loop `while has_unfinished_requests(): step()` delivers aborts and rejections.
        """
        return bool(self._requests or self._outbox)

    def get_request(self, request_id: str) -> Request | None:
        """The waiting or running request with this id; None once it finished (or if unknown)."""
        return self._requests.get(request_id)

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request (WAITING), or reject it at once if it can never run.

        Mutates: the request joins the waiting queue; or, if rejected, it is FINISHED with
        `FinishReason.ABORT` and `error` set, and its final Delta is emitted by the next `update`.
        Raises ValueError for a request that is not new (not WAITING, or already computed) or
        whose id is already waiting or running: those are caller bugs, not user errors.
        """
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id!r} is not a new WAITING request")
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already queued")
        error = self._rejection_reason(request)
        if error is not None:
            request.error = error
            self._finish(request, FinishReason.ABORT)
            self._outbox.append(_final_delta(request))
            return
        self._requests[request.request_id] = request
        self._arrival_order[request.request_id] = self._num_added
        self._num_added += 1
        bisect.insort(self._waiting, request, key=self._order_key)

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is (waiting, mid-prefill, decoding).

        Mutates: the request is FINISHED with `FinishReason.ABORT`, its slot and blocks are freed,
        and its final Delta (no new tokens) is emitted by the next `update`. A chunk of it already
        handed out by `schedule` is ignored by `update`. Unknown or finished ids are a no-op.
        """
        request = self._requests.get(request_id)
        if request is None:
            return
        self._finish(request, FinishReason.ABORT)
        self._outbox.append(_final_delta(request))

    # ---------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks (decode rows first) and allocate their blocks.

        Mutates: allocations, admissions (WAITING -> RUNNING) and preemptions (RUNNING ->
        WAITING); each chunk's positions and sampled token count as in flight until `update`
        (`num_computed_tokens` is left for `update`). Never exceeds the token budget and never
        lists a request twice. Returns an empty output when nothing can run.
        """
        plan = _StepPlan(self.config.max_num_batched_tokens, self.step_budget)
        self._schedule_decode_rows(plan)
        self._schedule_prefill_chunks(plan)
        if plan.num_preempted == 0:
            self._admit_waiting(plan)
        return self._build_output(plan)

    def resolve(self, output: SchedulerOutput) -> SchedulerOutput:
        """`output`, scheduled while the speculative step before it was in flight, placed on
        what that step committed (call it after that step's `update`). No-op for any other
        output.

        A decode row scheduled behind a step in flight starts at a lower bound (as if that
        step accepted no draft), holds a placeholder token, and has draft slots and sampling
        from lower bounds on the outputs (`DraftScheduling.cap`); its blocks cover the upper
        bound (`num_inflight_drafts`). Here, with the step applied, each such row gets its
        exact start (`num_computed_tokens`), its token, its sampling and its cap (never more
        than scheduled). Rows of requests that step finished (stop, length, abort, failure)
        are dropped: they never run. Mutates the in-flight draft counts of the rows, so it is
        called once per output, and the resolved output is what `update` then applies.
        """
        chunks = []
        for chunk in output.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished by the step before: this row is never computed
            if chunk.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                chunk = self._resolved_row(request, chunk)
            chunks.append(chunk)
        if len(chunks) == len(output.chunks) and all(
            a is b for a, b in zip(chunks, output.chunks, strict=True)
        ):
            return output
        return dataclasses.replace(
            output, chunks=tuple(chunks), num_tokens=sum(len(c.token_ids) for c in chunks)
        )

    def _resolved_row(self, request: Request, chunk: ScheduledChunk) -> ScheduledChunk:
        """A placeholder decode row at its exact position, once the step before is applied."""
        if request.num_inflight_tokens != 1 or request.num_output_placeholders != 1:
            raise RuntimeError(
                f"request {request.request_id!r}: a row is resolved while another step of it "
                "is in flight"
            )
        cap = 0
        if self.speculation is not None and chunk.num_draft_slots:
            exact = self.speculation.cap(request, self.config.max_model_len)
            cap = min(chunk.num_draft_slots, exact)
        request.num_inflight_drafts += cap - chunk.num_draft_slots
        start = request.num_computed_tokens
        sampling = _sampling_info(request, num_ahead=0)  # its draw follows the known outputs
        return dataclasses.replace(
            chunk,
            start_position=start,
            token_ids=(request.all_token_ids[start],),
            sampling=sampling,
            num_draft_slots=cap,
            block_table=self.kv_manager.block_table(request.request_id),
        )

    def update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> list[Delta]:
        """Apply one executed step; return the Deltas to stream, one per request with news.

        Mutates: each scheduled request's `num_computed_tokens` advances by its chunk length;
        each chunk with `sampling` appends `model_output.sampled[request_id]` to the outputs
        (logprobs from `model_output.logprobs` when present), stopping at the first token that
        meets a stop condition, in this order:
          1. a stop token: EOS (unless `ignore_eos`) or one of `params.stop_token_ids`, honoured
             only at output index >= `min_tokens` (the sampler bans them below that);
          2. `max_tokens` outputs reached;
          3. `max_model_len` tokens reached.
        A finished request is FINISHED with STOP or LENGTH and its KV is freed. With
        speculation a decode row may sample 1 + a tokens (a ≤ its `num_draft_slots` accepted
        drafts, whose positions the step computed): `num_computed_tokens` advances by a more.

        Returns: first the final Deltas of requests rejected or aborted since the last `update`
        (no new tokens, `finish_reason=ABORT`, `error` for rejections), then one Delta per
        sampled request (cumulative counts; `finish_reason` set on its last Delta). Chunks of
        requests aborted, finished or preempted after `schedule` are ignored (under async
        scheduling: the chunk in flight after a stop; its token is never emitted); a request
        in `model_output.failed` is FINISHED with ABORT and that reason as its `error` (its
        final Delta follows the rejections), and its chunk is not counted. Raises RuntimeError
        if the runner did not sample for a chunk that asked for it, or if the output does not
        match the request state.
        """
        deltas, self._outbox = self._outbox, []
        reuse = self.prefix_reuse
        if reuse is not None:
            reuse.poll()  # host copies that landed since the last step
        requests, running = self._requests, RequestStatus.RUNNING
        failed = model_output.failed
        for chunk in scheduler_output.chunks:
            request = requests.get(chunk.request_id)
            if request is None or request.status is not running:
                continue  # aborted, finished or preempted after schedule()
            num_new = len(chunk.token_ids)
            request.num_inflight_tokens -= num_new
            if chunk.sampling is not None:
                request.num_output_placeholders -= 1
            if chunk.num_draft_slots:
                request.num_inflight_drafts -= chunk.num_draft_slots
                num_new += _num_accepted(chunk, model_output)
            if failed and chunk.request_id in failed:
                request.error = failed[chunk.request_id]
                self._finish(request, FinishReason.ABORT)
                deltas.append(_final_delta(request))
                continue
            if request.num_computed_tokens != chunk.start_position:
                raise RuntimeError(
                    f"request {chunk.request_id!r}: chunk starts at {chunk.start_position} but "
                    f"{request.num_computed_tokens} tokens are computed (update out of order?)"
                )
            request.num_computed_tokens += num_new
            if reuse is not None:
                reuse.commit(request)
            if chunk.sampling is not None:
                deltas.append(self._append_sampled(request, model_output))
        if self.speculation is not None:
            self.speculation.observe(
                model_output.draft_survivals, self._requests, scheduler_output.draft_step
            )
        return deltas

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant. No mutation.

        Checks the KV manager's invariants, then: every unfinished request is in exactly one
        queue with the matching status; queues are in (priority, arrival) order; running requests
        hold a slot and blocks for their computed tokens and have a position left to compute;
        waiting requests hold nothing and have computed nothing; only running requests hold KV.
        """
        self.kv_manager.check_integrity()
        waiting_ids = [r.request_id for r in self._waiting]
        running_ids = [r.request_id for r in self._running]
        _require(len(set(waiting_ids)) == len(waiting_ids), "a request is queued twice in WAITING")
        _require(len(set(running_ids)) == len(running_ids), "a request is queued twice in RUNNING")
        _require(not set(waiting_ids) & set(running_ids), "a request is both waiting and running")
        _require(
            set(waiting_ids) | set(running_ids) == self._requests.keys(),
            "tracked requests differ from the queued ones",
        )
        _require(len(self._running) <= self.config.max_num_seqs, "more running than max_num_seqs")
        for queue in (self._waiting, self._running):
            keys = [self._order_key(r) for r in queue]
            _require(keys == sorted(keys), "a queue is out of (priority, arrival) order")
        for request in self._waiting:
            rid = request.request_id
            _require(request.status is RequestStatus.WAITING, f"waiting {rid!r} is not WAITING")
            _require(request.num_computed_tokens == 0, f"waiting {rid!r} has computed tokens")
            _require(
                request.num_inflight_tokens
                == request.num_output_placeholders
                == request.num_inflight_drafts
                == 0,
                f"waiting {rid!r} has a step in flight",
            )
            _require(not self.kv_manager.is_allocated(rid), f"waiting {rid!r} holds KV")
        for request in self._running:
            rid = request.request_id
            if self.prefix_reuse is not None:
                self.prefix_reuse.check_request(request)
            _require(request.status is RequestStatus.RUNNING, f"running {rid!r} is not RUNNING")
            _require(self.kv_manager.is_allocated(rid), f"running {rid!r} holds no slot")
            _require(
                len(self.kv_manager.block_table(rid))
                >= self.kv_manager.num_blocks_needed(request.num_computed_tokens),
                f"running {rid!r} holds too few blocks for its computed tokens",
            )
            _require(
                request.num_computed_tokens < request.num_tokens,
                f"running {rid!r} has no position left to compute",
            )
            _require(
                request.num_inflight_tokens >= 0
                and 0 <= request.num_output_placeholders <= request.num_inflight_tokens
                and request.num_inflight_drafts >= 0,
                f"running {rid!r} has inconsistent in-flight counts",
            )
        _require(
            self.kv_manager.stats().num_requests == len(self._running),
            "a request that is not running holds KV",
        )

    # ---------------------------------------------------------------- scheduling helpers

    def _order_key(self, request: Request) -> tuple[int, float, int]:
        return (
            request.params.priority,
            request.arrival_time,
            self._arrival_order[request.request_id],
        )

    def _schedule_decode_rows(self, plan: _StepPlan) -> None:
        """Schedule the running requests that decode (one position left), best first.

        NOTE: a decode row always takes exactly 1 position without asking the step budget:
        decode rows come first, so the step holds no multi-token chunk yet, and then
        `StepBudget.max_chunk(shape, start, 1)` is 1 by its contract. Blocks are allocated
        only when the row's end crosses the request's last block (`KVCacheManager.allocate`
        is a no-op otherwise)."""
        speculation = self.speculation
        for request in list(self._running):
            if plan.budget_left == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            scheduled = request.num_computed_tokens + request.num_inflight_tokens
            num_ahead = request.num_output_placeholders
            num_outputs = len(request.output_token_ids) + num_ahead
            num_tokens = len(request.prompt_token_ids) + num_outputs
            if num_tokens - scheduled != 1:
                continue
            if num_ahead and (
                self._ends_for_length(request.params, num_outputs, num_tokens)
                or self._waits_for_its_outputs(request)
            ):
                continue  # its step in flight samples its last token, or one this row needs
            drafts = 0 if speculation is None else self._draft_slots(request, plan)
            # Blocks up to the furthest position: the step in flight may commit its drafts.
            end = scheduled + request.num_inflight_drafts + 1 + drafts
            if self._allocate_or_preempt(request, end, plan):
                plan.add(request, 1, drafts)

    def _schedule_prefill_chunks(self, plan: _StepPlan) -> None:
        """Schedule the next chunk of the running requests still in prefill (or recompute),
        best first, each bounded by the token budget left and the step budget."""
        for request in list(self._running):
            if plan.budget_left == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            num_left = request.num_tokens_with_placeholders - request.num_scheduled_tokens
            if num_left == 1 or request.request_id in plan.num_new_tokens:
                continue
            if self._reaches_length_limit(request) or self._waits_for_its_outputs(request):
                continue  # its step in flight samples its last token, or one this row needs
            num_new = plan.chunk_len(request)
            if num_new == 0:
                continue  # the step budget is spent: this chunk waits for the next step
            end = request.num_scheduled_tokens + request.num_inflight_drafts + num_new
            if self._allocate_or_preempt(request, end, plan):
                plan.add(request, num_new)

    def _draft_slots(self, request: Request, plan: _StepPlan) -> int:
        """Drafts a decoding request may verify this step (0 without speculation), within the
        token budget left after its own row; an upper bound behind a step in flight."""
        if self.speculation is None:
            return 0
        cap = self.speculation.cap(
            request, self.config.max_model_len, num_ahead=request.num_output_placeholders
        )
        return max(0, min(cap, plan.budget_left - 1))

    def _reaches_length_limit(self, request: Request) -> bool:
        """True when the outputs a step in flight samples already end the request for length
        (`max_tokens`, `max_model_len`): the next token would be computed only to be dropped."""
        if request.num_output_placeholders == 0:
            return False
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        return self._ends_for_length(
            request.params, num_outputs, request.num_tokens_with_placeholders
        )

    def _ends_for_length(self, params: SamplingParams, num_outputs: int, num_tokens: int) -> bool:
        """Whether `num_outputs` outputs (of `num_tokens` tokens in all) end a request of
        `params` for length (`max_tokens`, `max_model_len`)."""
        max_tokens = params.max_tokens
        return (
            max_tokens is not None and num_outputs >= max_tokens
        ) or num_tokens >= self.config.max_model_len

    def _waits_for_its_outputs(self, request: Request) -> bool:
        """True when the next draw depends on the identity of a token a step in flight
        samples: a thinking budget's draw at its index is forced unless an earlier output
        ended the reasoning. That one row waits for the outputs (once per request)."""
        budget = request.params.thinking_budget
        return (
            budget is not None
            and request.num_output_placeholders > 0
            and request.num_output_tokens + request.num_output_placeholders == budget.max_tokens
        )

    def _allocate_or_preempt(self, request: Request, num_tokens: int, plan: _StepPlan) -> bool:
        """Give a running request blocks for positions `< num_tokens`, preempting the worst
        running requests until that succeeds. False if the request preempted itself."""
        while not self.kv_manager.allocate(request.request_id, num_tokens):
            victim = self._running[-1]  # worst (priority, arrival); never better than `request`
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """RUNNING -> WAITING by recompute: free KV, keep outputs, forget computed positions."""
        self._running.remove(request)
        self.kv_manager.free(request.request_id)
        plan.drop(request.request_id)
        plan.num_preempted += 1
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        if self.prefix_reuse is not None:
            self.prefix_reuse.forget(request)
        request.num_inflight_tokens = 0  # `update` ignores the chunk in flight: not RUNNING
        request.num_output_placeholders = 0
        request.num_inflight_drafts = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        bisect.insort(self._waiting, request, key=self._order_key)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in order until one does not fit (token or step budget, seqs,
        slots, KV)."""
        while (
            self._waiting and plan.budget_left > 0 and len(self._running) < self.config.max_num_seqs
        ):
            request = self._first_ready()
            if request is None:
                return
            hit = self.prefix_reuse.match(request) if self.prefix_reuse is not None else None
            num_new = plan.chunk_len(request, None if hit is None else hit.replay_start)
            # Reserve every known position, so the prefill never waits for blocks midway.
            cached = hit.blocks if hit is not None else ()
            if num_new == 0 or not self.kv_manager.allocate(
                request.request_id, request.num_tokens, cached
            ):
                return
            if hit is not None:
                self.prefix_reuse.apply(request, hit)  # computing restarts at its replay
            self._waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            bisect.insort(self._running, request, key=self._order_key)
            plan.add(request, num_new)

    def _first_ready(self) -> Request | None:
        """The first waiting request not waiting for KV from a directory tier."""
        reuse = self.prefix_reuse
        return next((r for r in self._waiting if reuse is None or reuse.is_ready(r)), None)

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        """The step's chunks in plan order; then each chunk's positions and sampled token count
        as in flight (`num_inflight_tokens`, `num_output_placeholders`, `num_inflight_drafts`)."""
        kv = self.kv_manager
        reuse = self.prefix_reuse
        draft_slots = plan.num_draft_slots
        chunks = []
        rows = []  # (request, chunk length, samples, draft slots), for the planner and counts
        for request_id, num_new in plan.num_new_tokens.items():
            request = self._requests[request_id]
            start = request.num_computed_tokens + request.num_inflight_tokens
            end = start + num_new
            num_known = len(request.prompt_token_ids) + len(request.output_token_ids)
            samples = end == num_known + request.num_output_placeholders
            num_drafts = draft_slots.get(request_id, 0) if draft_slots else 0
            if num_new == 1:
                token_ids = (_token_at(request, start, num_known),)
            else:
                token_ids = _token_range(request, start, end)
            chunks.append(
                ScheduledChunk(
                    request_id,
                    kv.slot(request_id),
                    kv.block_table(request_id),
                    start,
                    token_ids,
                    _sampling_info(request) if samples else None,
                    None if reuse is None else reuse.restore_info(request, start),
                    None if reuse is None else reuse.resume_info(request, start),
                    num_drafts,
                )
            )
            rows.append((request, num_new, samples, num_drafts))
        decision = self._draft_plan(rows)
        for request, num_new, samples, num_drafts in rows:
            request.num_inflight_tokens += num_new
            request.num_output_placeholders += samples
            request.num_inflight_drafts += num_drafts
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            chunks=tuple(chunks),
            num_tokens=sum(plan.num_new_tokens.values()),
            finished_request_ids=finished,
            draft_budget=decision.budget,
            draft_verify_all=decision.is_verify_all,
            draft_step=-1 if self.speculation is None else self.speculation.num_steps - 1,
        )

    def _draft_plan(self, rows: list[tuple[Request, int, bool, int]]) -> BudgetDecision:
        """The planner's budget for the step's draft slots (0 without speculation). rows: the
        step's (request, chunk length, samples, draft slots), before they count as in flight."""
        if self.speculation is None:
            return _NO_DRAFTS
        sampled, other_rows = [], 0
        for request, num_new, samples, num_drafts in rows:
            if samples:
                sampled.append((request, num_drafts))
            other_rows += num_new - samples
        return self.speculation.plan(sampled, other_rows)

    # ---------------------------------------------------------------- update helpers

    def _append_sampled(self, request: Request, model_output: ModelOutput) -> Delta:
        rid = request.request_id
        sampled = model_output.sampled.get(rid)
        if not sampled:
            raise RuntimeError(f"the runner sampled no token for {rid!r}")
        outputs = request.output_token_ids
        reason = None
        if len(sampled) == 1:
            outputs.append(sampled[0])
            reason = self._stop_reason(request)
            new_ids = [sampled[0]]
        else:
            num_new = 0
            for token in sampled:
                outputs.append(token)
                num_new += 1
                reason = self._stop_reason(request)
                if reason is not None:
                    break
            new_ids = outputs[-num_new:]
        logprobs = model_output.logprobs.get(rid) if model_output.logprobs else None
        if reason is not None:
            self._finish(request, reason)
        queue_time = None
        if len(outputs) == len(new_ids) and request.first_scheduled_time is not None:
            queue_time = max(0.0, request.first_scheduled_time - request.arrival_time)
        return Delta(
            rid,
            request.index,
            new_ids,
            None if logprobs is None else list(logprobs[: len(new_ids)]),
            len(request.prompt_token_ids),
            len(outputs),
            reason,
            None,  # error
            queue_time,
            request.num_cached_tokens,
        )

    def _stop_reason(self, request: Request) -> FinishReason | None:
        """Why the request stops after its last output token, or None."""
        params = request.params
        outputs = request.output_token_ids
        token = outputs[-1]
        num_outputs = len(outputs)
        if num_outputs > params.min_tokens and (
            (token == request.eos_token_id and not params.ignore_eos)
            or token in params.stop_token_ids
        ):
            return FinishReason.STOP
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return FinishReason.LENGTH
        if len(request.prompt_token_ids) + num_outputs >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Any state -> FINISHED: leave the queues, free KV, tell the runner next step."""
        if request.request_id in self._requests:
            del self._requests[request.request_id]
            del self._arrival_order[request.request_id]
            queue = self._running if request.status is RequestStatus.RUNNING else self._waiting
            queue.remove(request)
            if self.prefix_reuse is not None and reason is not FinishReason.ABORT:
                self.prefix_reuse.retire(request)  # before its state slot is reused
            self.kv_manager.free(request.request_id)
            if self.prefix_reuse is not None:
                self.prefix_reuse.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_ids.append(request.request_id)
        if self.speculation is not None:
            self.speculation.forget(request.request_id)

    def _rejection_reason(self, request: Request) -> str | None:
        return self.rejection_reason(request.num_prompt_tokens, request.params.max_tokens)

    @property
    def limits(self) -> RequestLimits:
        """This scheduler's context limit, KV pool and activation bound (configuration)."""
        pool = self.kv_manager.config
        return RequestLimits(
            self.config.max_model_len,
            pool.block_tokens,
            pool.num_blocks,
            self.step_budget.max_context_len(),
        )

    def rejection_reason(self, num_prompt: int, max_tokens: int | None) -> str | None:
        """Why a request of this prompt length and output limit can never run with this
        context limit, pool and memory budget, or None (`RequestLimits.rejection_reason`).
        Pure: reads only configuration, so the front end may ask before admitting a request
        (a 400 instead of a failed stream)."""
        return self.limits.rejection_reason(num_prompt, max_tokens)


def _num_accepted(chunk: ScheduledChunk, model_output: ModelOutput) -> int:
    """Accepted drafts of a chunk: its sampled tokens but the last (0 without drafts)."""
    if not chunk.num_draft_slots:
        return 0
    sampled = model_output.sampled.get(chunk.request_id, ())
    accepted = max(0, len(sampled) - 1)
    if accepted > chunk.num_draft_slots:
        raise RuntimeError(
            f"request {chunk.request_id!r}: {accepted} drafts accepted, at most "
            f"{chunk.num_draft_slots} were allowed"
        )
    return accepted


def _token_at(request: Request, position: int, num_known: int) -> int:
    """The token id at `position` (`PLACEHOLDER_TOKEN_ID` at or past the `num_known` tokens)."""
    if position >= num_known:
        return PLACEHOLDER_TOKEN_ID
    num_prompt = len(request.prompt_token_ids)
    if position < num_prompt:
        return request.prompt_token_ids[position]
    return request.output_token_ids[position - num_prompt]


def _token_range(request: Request, start: int, end: int) -> tuple[int, ...]:
    """Token ids at positions `start .. end − 1` without concatenating prompt and output;
    `PLACEHOLDER_TOKEN_ID` at positions a step in flight samples."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    num_unknown = max(0, end - max(start, request.num_tokens))
    if num_unknown:
        known = _token_range(request, start, end - num_unknown) if start < end - num_unknown else ()
        return (*known, *[PLACEHOLDER_TOKEN_ID] * num_unknown)
    if end <= num_prompt:
        return tuple(prompt[start:end])
    if start >= num_prompt:
        return tuple(output[start - num_prompt : end - num_prompt])
    return (*prompt[start:], *output[: end - num_prompt])


_NO_DRAFTS = BudgetDecision(budget=0, is_verify_all=True, reason="off")


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0
        or params.frequency_penalty != 0
        or params.repetition_penalty != 1
    )


def _sampling_info(request: Request, num_ahead: int | None = None) -> SamplingInfo:
    """The sampling of the request's next draw after `num_ahead` outputs still in flight
    (default: its placeholders, before this row's own is counted)."""
    if num_ahead is None:
        num_ahead = request.num_output_placeholders
    params = request.params
    history = None
    if _uses_penalties(params):
        history = (*request.all_token_ids, *[PLACEHOLDER_TOKEN_ID] * num_ahead)
    budget = params.thinking_budget
    return SamplingInfo(
        params,
        request.seed,
        len(request.output_token_ids) + num_ahead,  # output_index
        len(request.prompt_token_ids),
        history,
        request.constraint,
        # NOTE: a budget forces only the draw at its index, which is never scheduled ahead of
        # the outputs before it (`_waits_for_its_outputs`), so none is a placeholder then.
        None if budget is None or num_ahead else budget.forced_token(request.output_token_ids),
    )


def _final_delta(request: Request) -> Delta:
    """The last Delta of a request finished outside `update` (rejected or aborted)."""
    return Delta(
        request_id=request.request_id,
        index=request.index,
        token_ids=[],
        logprobs=None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        finish_reason=request.finish_reason,
        error=request.error,
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"Scheduler integrity: {message}")
