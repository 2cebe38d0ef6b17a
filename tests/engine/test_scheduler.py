"""Scheduler tests driven by a fake model (no torch): budget, chunking, ordering, admission,
preemption and resume, rejection, cancellation, stop conditions, randomized runs.

The fake runner simulates the model's paged state: it writes every chunk's tokens into a pool of
blocks through the chunk's block table, checks that the slot's state continues where it stopped,
and "samples" a hash of the whole context it reads back through the block table, keyed by the
request seed. So a wrong block table, a slot handed to two requests or a skipped position changes
the output, and a correct recompute after preemption reproduces it exactly.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections import defaultdict

import pytest

from engine.kv_cache import CacheConfig, KVCacheManager
from engine.outputs import Delta, ModelOutput, SchedulerOutput, TokenLogprob
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_budget import LinearCost, StepBudget, StepShape, StepTimeModel

BLOCK_TOKENS = 4
EOS = 0
VOCAB = 1000  # the fake model samples ids 1 .. VOCAB - 1, never EOS unless scripted


def fake_next_token(context: list[int], seed: int) -> int:
    """Deterministic function of (seed, the whole context): stands in for the model + sampler."""
    value = seed + 12345
    for token in context:
        value = (value * 1_000_003 + token + 1) % (2**61 - 1)
    return 1 + value % (VOCAB - 1)


def reference_output(prompt: list[int], seed: int, num_tokens: int) -> list[int]:
    """What an unbatched, unpreempted run of the fake model produces (no stop tokens)."""
    output: list[int] = []
    for _ in range(num_tokens):
        output.append(fake_next_token(prompt + output, seed))
    return output


class FakeRunner:
    """Executes a SchedulerOutput against a simulated paged KV pool (see the module docstring).

    script: request id -> {output index: token id} forced tokens (to hit EOS / stop ids).
    num_sampled: tokens returned per sampled chunk (> 1 imitates speculative decoding).
    """

    def __init__(
        self,
        cache: CacheConfig,
        script: dict[str, dict[int, int]] | None = None,
        num_sampled: int = 1,
    ) -> None:
        self.cache = cache
        self.pool: dict[tuple[int, int], int] = {}  # (block, row) -> token id
        self.slot_state: dict[int, tuple[str, int]] = {}  # slot -> (request id, next position)
        self.script = script or {}
        self.num_sampled = num_sampled

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        for chunk in out.chunks:
            rid, start = chunk.request_id, chunk.start_position
            end = start + len(chunk.token_ids)
            if start == 0:
                self.slot_state[chunk.slot] = (rid, 0)
            assert self.slot_state.get(chunk.slot) == (rid, start), "slot state does not continue"
            assert len(chunk.block_table) * self.cache.block_tokens >= end, "table too short"
            for offset, token in enumerate(chunk.token_ids):
                self.pool[self._address(chunk.block_table, start + offset)] = token
            self.slot_state[chunk.slot] = (rid, end)
            if chunk.sampling is None:
                continue
            info = chunk.sampling
            assert info.num_prompt_tokens + info.output_index == end, "sampling at wrong position"
            context = [self.pool[self._address(chunk.block_table, p)] for p in range(end)]
            tokens = []
            for k in range(self.num_sampled):
                forced = self.script.get(rid, {}).get(info.output_index + k)
                tokens.append(forced if forced is not None else fake_next_token(context, info.seed))
                context.append(tokens[-1])
            sampled[rid] = tokens
            if info.params.logprobs:
                logprobs[rid] = [TokenLogprob(t, -float(t % 7)) for t in tokens]
        return ModelOutput(sampled=sampled, logprobs=logprobs)

    def _address(self, table: tuple[int, ...], position: int) -> tuple[int, int]:
        return table[position // self.cache.block_tokens], position % self.cache.block_tokens


class Harness:
    """Scheduler + KV manager + fake runner; checks invariants after every operation."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        num_slots: int = 8,
        max_model_len: int = 256,
        budget: int = 32,
        max_num_seqs: int = 8,
        script: dict[str, dict[int, int]] | None = None,
        num_sampled: int = 1,
        step_budget: StepBudget | None = None,
    ) -> None:
        self.cache = CacheConfig(num_blocks, num_slots, BLOCK_TOKENS)
        self.kv = KVCacheManager(self.cache)
        self.config = SchedulerConfig(
            max_model_len=max_model_len, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs
        )
        self.scheduler = Scheduler(self.config, self.kv, step_budget)
        self.runner = FakeRunner(self.cache, script, num_sampled)
        self.requests: dict[str, Request] = {}
        self.deltas: dict[str, list[Delta]] = defaultdict(list)
        self.outputs: list[SchedulerOutput] = []
        self.num_arrivals = 0

    def add(
        self,
        request_id: str,
        prompt: list[int] | int,
        *,
        seed: int | None = None,
        **params,
    ) -> Request:
        if isinstance(prompt, int):
            prompt = [1 + (7 * i + len(request_id)) % (VOCAB - 1) for i in range(prompt)]
        params.setdefault("max_tokens", 8)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            params=SamplingParams(**params),
            seed=seed if seed is not None else len(self.requests),
            arrival_time=float(self.num_arrivals),
            eos_token_id=EOS,
        )
        self.num_arrivals += 1
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        self.scheduler.check_integrity()
        return request

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.scheduler.check_integrity()

    def schedule(self) -> SchedulerOutput:
        before = {
            rid: (r.status, r.num_tokens - r.num_computed_tokens)
            for rid, r in self.requests.items()
        }
        out = self.scheduler.schedule()
        self.scheduler.check_integrity()
        self._check_output(out, before)
        self.outputs.append(out)
        return out

    def update(self, out: SchedulerOutput) -> list[Delta]:
        deltas = self.scheduler.update(out, self.runner.execute(out))
        self.scheduler.check_integrity()
        for delta in deltas:
            history = self.deltas[delta.request_id]
            assert not history or history[-1].finish_reason is None, "delta after the final one"
            history.append(delta)
        return deltas

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.update(out)
        return out

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        else:
            raise AssertionError("requests did not finish")
        self.check_all_finished()

    def check_all_finished(self) -> None:
        assert self.scheduler.num_waiting == 0 and self.scheduler.num_running == 0
        assert self.kv.num_free_blocks == self.cache.num_blocks
        assert self.kv.num_free_slots == self.cache.num_slots
        for rid, request in self.requests.items():
            assert request.is_finished, rid
            deltas = self.deltas[rid]
            assert deltas and deltas[-1].finish_reason is request.finish_reason, rid
            assert [t for d in deltas for t in d.token_ids] == request.output_token_ids, rid
            assert all(d.num_output_tokens <= request.num_output_tokens for d in deltas)
            assert deltas[-1].num_output_tokens == request.num_output_tokens

    def _check_output(self, out: SchedulerOutput, before: dict) -> None:
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert out.num_tokens == sum(len(c.token_ids) for c in out.chunks)
        assert out.num_tokens <= self.config.max_num_batched_tokens, "token budget exceeded"
        assert len(out.chunks) <= self.config.max_num_seqs
        seen_other = False
        for chunk in out.chunks:
            request = self.requests[chunk.request_id]
            status, num_left = before[chunk.request_id]
            is_decode = status is RequestStatus.RUNNING and num_left == 1
            assert not (is_decode and seen_other), "decode row after a prefill chunk"
            seen_other = seen_other or not is_decode
            assert chunk.token_ids, "empty chunk"
            assert chunk.start_position == request.num_computed_tokens
            end = chunk.start_position + len(chunk.token_ids)
            assert list(chunk.token_ids) == request.all_token_ids[chunk.start_position : end]
            assert (chunk.sampling is not None) == (end == request.num_tokens)
            if chunk.sampling is not None:
                assert chunk.sampling.output_index == request.num_output_tokens
                assert chunk.sampling.seed == request.seed


def chunks_of(harness: Harness, request_id: str) -> list[tuple[int, int]]:
    """(start, length) of every chunk scheduled for a request, in step order."""
    return [
        (c.start_position, len(c.token_ids))
        for out in harness.outputs
        for c in out.chunks
        if c.request_id == request_id
    ]


def first_step(harness: Harness, request_id: str) -> int:
    """Index of the first step that scheduled the request."""
    return next(i for i, out in enumerate(harness.outputs) if chunks_in(out, request_id))


def chunks_in(out: SchedulerOutput, request_id: str) -> bool:
    return any(c.request_id == request_id for c in out.chunks)


# ------------------------------------------------------------------------------------ config


def test_scheduler_imports_no_torch() -> None:
    code = "import sys, engine.scheduler, engine.kv_cache; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"max_model_len": 64, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 64, "max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 64, "max_num_batched_tokens": 8, "max_num_seqs": 16}, ">= max_num_seqs"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_config_defaults() -> None:
    config = SchedulerConfig(max_model_len=4096)
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (32768, 256)
    with pytest.raises(TypeError):
        SchedulerConfig()  # max_model_len has no default


# ------------------------------------------------------------------------ budget and chunks


def test_long_prompt_is_chunked_to_the_budget_and_covers_every_position_once() -> None:
    h = Harness(budget=16, max_num_seqs=4)
    h.add("long", 50, max_tokens=3)
    h.run()
    assert chunks_of(h, "long") == [(0, 16), (16, 16), (32, 16), (48, 2), (50, 1), (51, 1)]
    assert h.requests["long"].output_token_ids == reference_output(
        h.requests["long"].prompt_token_ids, h.requests["long"].seed, 3
    )


def test_chunked_prefill_is_mixed_with_decode_rows_first() -> None:
    h = Harness(budget=8, max_num_seqs=4)
    h.add("a", 3, max_tokens=10)
    h.step()  # a: whole prompt, samples its first token
    h.add("b", 20, max_tokens=2)
    h.add("c", 5, max_tokens=2)
    out = h.step()
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 7)]
    out = h.step()
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 7)]
    out = h.step()  # b's last 6 positions, then c gets the 1 remaining position
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [
        ("a", 1),
        ("b", 6),
        ("c", 1),
    ]
    h.run()
    for rid in "abc":
        request = h.requests[rid]
        assert request.output_token_ids == reference_output(
            request.prompt_token_ids, request.seed, request.params.max_tokens
        )
        covered = [p for start, n in chunks_of(h, rid) for p in range(start, start + n)]
        assert covered == list(range(request.num_tokens - 1))


def test_budget_is_respected_with_many_requests() -> None:
    h = Harness(budget=12, max_num_seqs=6, num_blocks=200, num_slots=6)
    for i in range(20):
        h.add(f"r{i}", 1 + (i * 7) % 30, max_tokens=1 + i % 5)
    h.run()
    assert max(out.num_tokens for out in h.outputs) == 12


# ------------------------------------------------------------------------------- ordering


def test_fcfs_within_a_priority() -> None:
    h = Harness(max_num_seqs=1, budget=32)
    for rid in ["x", "y", "z"]:
        h.add(rid, 5, max_tokens=2)
    h.run()
    assert first_step(h, "x") < first_step(h, "y") < first_step(h, "z")


def test_lower_priority_value_is_admitted_first() -> None:
    h = Harness(max_num_seqs=1, budget=32)
    h.add("late-low", 5, max_tokens=2, priority=5)
    h.add("urgent", 5, max_tokens=2, priority=-1)
    h.add("normal", 5, max_tokens=2, priority=0)
    order = []
    while h.scheduler.has_unfinished_requests():
        for chunk in h.step().chunks:
            if chunk.request_id not in order:
                order.append(chunk.request_id)
    assert order == ["urgent", "normal", "late-low"]
    h.check_all_finished()


# ------------------------------------------------------------------------------ admission


def test_admission_waits_for_free_blocks() -> None:
    # 6 blocks of 4 tokens; each prompt needs 4 blocks (16 tokens) -> one at a time.
    h = Harness(num_blocks=6, budget=64, max_model_len=64)
    h.add("a", 16, max_tokens=4)
    h.add("b", 16, max_tokens=4)
    out = h.step()
    assert [c.request_id for c in out.chunks] == ["a"]
    assert h.scheduler.num_waiting == 1 and h.requests["b"].status is RequestStatus.WAITING
    h.run()
    assert all(r.num_preemptions == 0 for r in h.requests.values())


def test_admission_limited_by_slots_and_max_num_seqs() -> None:
    for num_slots, max_num_seqs in [(2, 8), (8, 2)]:
        h = Harness(num_slots=num_slots, max_num_seqs=max_num_seqs)
        for i in range(5):
            h.add(f"r{i}", 3, max_tokens=3)
        out = h.step()
        assert [c.request_id for c in out.chunks] == ["r0", "r1"]
        while h.scheduler.has_unfinished_requests():
            assert h.scheduler.num_running <= 2
            h.step()
        h.check_all_finished()


def test_head_of_line_request_is_not_overtaken() -> None:
    h = Harness(num_blocks=8, budget=64, max_model_len=64)
    h.add("a", 20, max_tokens=2)  # 5 blocks
    h.add("big", 20, max_tokens=2)  # 5 blocks: must wait for a
    h.add("small", 2, max_tokens=2)  # would fit, but does not overtake "big"
    out = h.step()
    assert [c.request_id for c in out.chunks] == ["a"]
    h.run()
    assert first_step(h, "a") < first_step(h, "big") <= first_step(h, "small")


# ----------------------------------------------------------------------------- preemption


def run_batch(num_blocks: int, specs: list[tuple[str, int, int, int]]) -> Harness:
    """Run requests (id, prompt length, max_tokens, priority) all added up front."""
    h = Harness(num_blocks=num_blocks, num_slots=8, budget=64, max_model_len=128)
    for rid, prompt_len, max_tokens, priority in specs:
        h.add(rid, prompt_len, max_tokens=max_tokens, priority=priority, seed=sum(map(ord, rid)))
    h.run()
    return h


SPECS = [("p", 6, 30, 0), ("q", 9, 25, 0), ("r", 3, 40, 0), ("s", 7, 20, 0)]


def test_preempted_request_resumes_with_identical_tokens() -> None:
    roomy = run_batch(200, SPECS)
    tight = run_batch(14, SPECS)  # each needs up to 11 blocks alone; together far more
    assert all(r.num_preemptions == 0 for r in roomy.requests.values())
    assert sum(r.num_preemptions for r in tight.requests.values()) > 0
    assert tight.scheduler.num_preemptions == sum(
        r.num_preemptions for r in tight.requests.values()
    )
    assert roomy.scheduler.num_preemptions == 0
    for rid, *_ in SPECS:
        assert tight.requests[rid].output_token_ids == roomy.requests[rid].output_token_ids
        assert tight.requests[rid].finish_reason is FinishReason.LENGTH


def test_preemption_evicts_the_latest_arrival_first() -> None:
    h = Harness(num_blocks=6, budget=64, max_model_len=64)
    h.add("old", 4, max_tokens=16)  # grows to 5 blocks
    h.add("new", 4, max_tokens=16)
    while h.requests["new"].num_preemptions == 0:
        assert h.requests["old"].num_preemptions == 0
        h.step()
    preempting = h.outputs[-1]
    assert [c.request_id for c in preempting.chunks] == ["old"]  # admission skipped this step
    assert h.requests["new"].status is RequestStatus.WAITING
    assert h.requests["new"].num_computed_tokens == 0
    assert h.requests["new"].num_output_tokens > 0  # outputs kept for the recompute
    h.run()
    assert h.requests["old"].num_preemptions == 0
    for request in h.requests.values():
        assert request.output_token_ids == reference_output(
            request.prompt_token_ids, request.seed, 16
        )


def test_no_admission_in_a_step_that_preempted() -> None:
    h = Harness(num_blocks=6, budget=64, max_model_len=64, max_num_seqs=2)
    h.add("old", 4, max_tokens=16)
    h.add("new", 4, max_tokens=16)
    h.step()
    h.add("vip", 1, max_tokens=2, priority=-1)  # waits for a seat (max_num_seqs), needs 1 block
    while h.requests["new"].num_preemptions == 0:
        h.step()
    # A seat and a block are free after the preemption, but memory is tight: admit next step.
    assert h.kv.num_free_blocks >= 1 and h.scheduler.num_running == 1
    assert [c.request_id for c in h.outputs[-1].chunks] == ["old"]
    assert [c.request_id for c in h.step().chunks] == ["old", "vip"]
    h.run()


def test_preemption_evicts_the_worst_priority_first() -> None:
    h = Harness(num_blocks=6, budget=64, max_model_len=64)
    h.add("background", 4, max_tokens=16, priority=3)
    h.add("interactive", 4, max_tokens=16, priority=0)
    h.run()
    assert h.requests["background"].num_preemptions > 0
    assert h.requests["interactive"].num_preemptions == 0


def test_resumed_request_recomputes_prompt_and_outputs_in_chunks() -> None:
    h = Harness(num_blocks=6, budget=8, max_num_seqs=4, max_model_len=64)
    h.add("old", 4, max_tokens=16)
    h.add("new", 4, max_tokens=16)
    h.run()
    new_chunks = chunks_of(h, "new")
    restart = next(i for i, (start, _) in enumerate(new_chunks) if i > 0 and start == 0)
    covered = [p for start, n in new_chunks[restart:] for p in range(start, start + n)]
    assert covered == list(range(h.requests["new"].num_tokens - 1))
    assert all(n <= 8 for _, n in new_chunks)


# ------------------------------------------------------------------------------ rejection


@pytest.mark.parametrize(
    ("prompt_len", "params", "message"),
    [
        (0, {}, "prompt is empty"),
        (60, {"max_tokens": 8}, "plus max_tokens (8) exceeds the context length (64"),
        (64, {"max_tokens": None}, "leaves no room to generate"),
        (30, {"max_tokens": 30}, "needs 15 KV blocks, but the whole cache holds 12 blocks"),
    ],
)
def test_impossible_request_is_rejected_while_others_proceed(
    prompt_len: int, params: dict, message: str
) -> None:
    h = Harness(num_blocks=12, max_model_len=64)
    h.add("ok", 5, max_tokens=3)
    bad = h.add("bad", prompt_len, **params)
    assert bad.is_finished and bad.finish_reason is FinishReason.ABORT
    assert message in bad.error
    assert h.scheduler.get_request("bad") is None and h.scheduler.num_waiting == 1
    deltas = h.update(h.schedule())
    assert deltas[0].request_id == "bad" and deltas[0].error == bad.error
    assert deltas[0].finish_reason is FinishReason.ABORT and deltas[0].token_ids == []
    h.run()
    assert h.requests["ok"].finish_reason is FinishReason.LENGTH


def test_request_that_exactly_fills_the_pool_is_accepted() -> None:
    # 12 blocks x 4 = 48 positions: a request reaching 49 tokens computes positions 0..47 only.
    h = Harness(num_blocks=12, max_model_len=64)
    request = h.add("full", 40, max_tokens=9)
    assert not request.is_finished
    h.run()
    assert request.num_output_tokens == 9


def test_rejection_surfaces_through_update_even_when_idle() -> None:
    h = Harness(max_model_len=16)
    h.add("bad", 20)
    assert h.scheduler.has_unfinished_requests()
    out = h.schedule()
    assert out.is_empty and out.finished_request_ids == ("bad",)
    assert [d.request_id for d in h.update(out)] == ["bad"]
    assert not h.scheduler.has_unfinished_requests()


def test_add_request_rejects_caller_bugs() -> None:
    h = Harness()
    h.add("a", 3)
    with pytest.raises(ValueError, match="already queued"):
        h.add("a", 3)
    used = Request("u", [1, 2], SamplingParams(), seed=0, arrival_time=0.0, num_computed_tokens=1)
    with pytest.raises(ValueError, match="not a new WAITING request"):
        h.scheduler.add_request(used)
    h.scheduler.check_integrity()


# ---------------------------------------------------------------------------- cancellation


def test_abort_while_waiting() -> None:
    h = Harness(max_num_seqs=1)
    h.add("a", 5, max_tokens=4)
    h.add("b", 5, max_tokens=4)
    h.step()
    assert h.requests["b"].status is RequestStatus.WAITING
    h.abort("b")
    assert h.scheduler.num_waiting == 0
    h.run()
    assert h.requests["b"].finish_reason is FinishReason.ABORT
    assert h.deltas["b"][-1].token_ids == [] and h.deltas["b"][-1].error is None
    assert h.requests["a"].finish_reason is FinishReason.LENGTH


def test_abort_mid_prefill() -> None:
    h = Harness(budget=8)
    h.add("long", 40, max_tokens=4)
    h.step()
    assert 0 < h.requests["long"].num_computed_tokens < 40
    h.abort("long")
    assert h.kv.num_free_blocks == h.cache.num_blocks and h.kv.num_free_slots == h.cache.num_slots
    out = h.schedule()
    assert out.finished_request_ids == ("long",) and out.is_empty
    h.update(out)
    h.run()
    assert h.requests["long"].finish_reason is FinishReason.ABORT
    assert h.requests["long"].num_output_tokens == 0


def test_abort_while_decoding() -> None:
    h = Harness()
    h.add("a", 5, max_tokens=20)
    h.add("b", 5, max_tokens=5)
    for _ in range(4):
        h.step()
    assert h.requests["a"].num_output_tokens == 4
    h.abort("a")
    h.run()
    assert h.requests["a"].finish_reason is FinishReason.ABORT
    assert h.deltas["a"][-1].num_output_tokens == 4
    assert h.requests["b"].num_output_tokens == 5


def test_abort_between_schedule_and_update_ignores_the_sampled_token() -> None:
    h = Harness()
    h.add("a", 5, max_tokens=20)
    h.add("b", 5, max_tokens=3)
    h.step()
    out = h.schedule()
    h.abort("a")
    deltas = h.update(out)
    assert [(d.request_id, d.finish_reason, d.token_ids) for d in deltas][0] == (
        "a",
        FinishReason.ABORT,
        [],
    )
    assert h.requests["a"].num_output_tokens == 1
    h.run()


def test_abort_of_unknown_or_finished_request_is_a_noop() -> None:
    h = Harness()
    h.add("a", 3, max_tokens=2)
    h.run()
    h.abort("a")
    h.abort("never-added")
    h.abort("a")
    assert not h.scheduler.has_unfinished_requests()
    assert h.requests["a"].finish_reason is FinishReason.LENGTH


def test_abort_a_preempted_request() -> None:
    h = Harness(num_blocks=6, budget=64, max_model_len=64)
    h.add("old", 4, max_tokens=16)
    h.add("new", 4, max_tokens=16)
    while h.requests["new"].num_preemptions == 0:
        h.step()
    h.abort("new")
    h.run()
    assert h.requests["new"].finish_reason is FinishReason.ABORT


# ------------------------------------------------------------------------- stop conditions


def test_eos_stops_and_is_kept() -> None:
    h = Harness(script={"a": {3: EOS}})
    h.add("a", 5, max_tokens=10)
    h.run()
    assert h.requests["a"].finish_reason is FinishReason.STOP
    assert h.requests["a"].num_output_tokens == 4 and h.requests["a"].output_token_ids[-1] == EOS


def test_ignore_eos_continues_to_max_tokens() -> None:
    h = Harness(script={"a": {3: EOS}})
    h.add("a", 5, max_tokens=10, ignore_eos=True)
    h.run()
    assert h.requests["a"].finish_reason is FinishReason.LENGTH
    assert h.requests["a"].num_output_tokens == 10


def test_stop_token_ids_stop() -> None:
    h = Harness(script={"a": {2: 77}, "b": {2: 77}})
    h.add("a", 5, max_tokens=10, stop_token_ids=(77,))
    h.add("b", 5, max_tokens=10)  # 77 is not a stop id for b
    h.run()
    assert h.requests["a"].finish_reason is FinishReason.STOP
    assert h.requests["a"].output_token_ids[-1] == 77 and h.requests["a"].num_output_tokens == 3
    assert h.requests["b"].num_output_tokens == 10


def test_min_tokens_defers_stop_tokens() -> None:
    h = Harness(script={"a": {1: EOS, 2: 77, 3: EOS}})
    h.add("a", 5, max_tokens=10, min_tokens=3, stop_token_ids=(77,))
    h.run()
    # Outputs 1 and 2 are below min_tokens=3; output index 3 may stop.
    assert h.requests["a"].finish_reason is FinishReason.STOP
    assert h.requests["a"].num_output_tokens == 4


def test_stop_token_at_max_tokens_reports_stop() -> None:
    h = Harness(script={"a": {3: EOS}})
    h.add("a", 5, max_tokens=4)
    h.run()
    assert h.requests["a"].finish_reason is FinishReason.STOP


def test_max_model_len_stops_without_max_tokens() -> None:
    h = Harness(max_model_len=20, num_blocks=5)
    h.add("a", 5, max_tokens=None)
    h.run()
    assert h.requests["a"].finish_reason is FinishReason.LENGTH
    assert h.requests["a"].num_tokens == 20


def test_several_sampled_tokens_per_step_stop_at_the_first_stop_token() -> None:
    h = Harness(script={"a": {4: EOS}}, num_sampled=3)
    h.add("a", 5, max_tokens=20)
    h.add("b", 5, max_tokens=7)
    h.run()
    assert h.requests["a"].num_output_tokens == 5 and h.requests["a"].output_token_ids[-1] == EOS
    assert h.requests["b"].num_output_tokens == 7  # cut at max_tokens mid-step
    assert [len(d.token_ids) for d in h.deltas["b"]] == [3, 3, 1]
    # Every position is still computed exactly once, in order.
    covered = [p for start, n in chunks_of(h, "b") for p in range(start, start + n)]
    assert covered == list(range(h.requests["b"].num_tokens - 1))


# ------------------------------------------------------------------ sampling info, deltas


@pytest.mark.parametrize(
    ("params", "has_history"),
    [
        ({}, False),
        ({"temperature": 0.0, "top_k": 5, "logit_bias": {3: 1.0}}, False),
        ({"presence_penalty": 0.5}, True),
        ({"frequency_penalty": -0.5}, True),
        ({"repetition_penalty": 1.2}, True),
    ],
)
def test_history_present_exactly_when_penalties_are_on(params: dict, has_history: bool) -> None:
    h = Harness(budget=4, max_num_seqs=4)
    request = h.add("a", 6, max_tokens=3, **params)
    sampled = 0
    while h.scheduler.has_unfinished_requests():
        for chunk in h.step().chunks:
            if chunk.sampling is None:
                continue
            sampled += 1
            info = chunk.sampling
            assert info.num_prompt_tokens == 6 and info.params is request.params
            if has_history:
                assert info.history == tuple(request.all_token_ids[: 6 + info.output_index])
            else:
                assert info.history is None
    assert sampled == 3


def test_logprobs_are_attached_to_deltas() -> None:
    h = Harness()
    h.add("a", 5, max_tokens=3, logprobs=True, top_logprobs=2)
    h.add("b", 5, max_tokens=3)
    h.run()
    assert all(d.logprobs is None for d in h.deltas["b"])
    entries = [lp for d in h.deltas["a"] for lp in d.logprobs]
    assert [lp.token_id for lp in entries] == h.requests["a"].output_token_ids


def test_deltas_carry_cumulative_counts() -> None:
    h = Harness()
    h.add("a", 5, max_tokens=3)
    h.run()
    assert [(d.num_prompt_tokens, d.num_output_tokens) for d in h.deltas["a"]] == [
        (5, 1),
        (5, 2),
        (5, 3),
    ]
    assert [d.finish_reason for d in h.deltas["a"]] == [None, None, FinishReason.LENGTH]


def test_deltas_carry_the_choice_index() -> None:
    h = Harness(max_model_len=16)
    for index, rid in enumerate(["c0", "c1", "c2"]):
        prompt = [5] * (20 if rid == "c2" else 3)  # c2 is rejected, c1 is aborted
        request = Request(rid, prompt, SamplingParams(max_tokens=2), 0, 0.0, EOS, index=index)
        h.requests[rid] = request
        h.scheduler.add_request(request)
    h.abort("c1")
    h.run()
    assert {rid: {d.index for d in h.deltas[rid]} for rid in h.requests} == {
        "c0": {0},
        "c1": {1},
        "c2": {2},
    }


def test_finished_requests_are_reported_to_the_runner_once() -> None:
    h = Harness()
    h.add("a", 3, max_tokens=1)
    h.add("b", 3, max_tokens=5)
    h.step()
    assert h.requests["a"].is_finished
    assert h.step().finished_request_ids == ("a",)
    assert h.step().finished_request_ids == ()
    h.run()


def test_update_rejects_a_missing_sample() -> None:
    h = Harness()
    h.add("a", 3)
    out = h.schedule()
    with pytest.raises(RuntimeError, match="sampled no token"):
        h.scheduler.update(out, ModelOutput(sampled={}, logprobs={}))


# ---------------------------------------------------------------------------- randomized


@pytest.mark.parametrize("seed", range(10))
def test_randomized_requests_with_aborts(seed: int) -> None:
    rng = random.Random(seed)
    h = Harness(
        num_blocks=rng.randrange(10, 30),
        num_slots=rng.randrange(2, 8),
        budget=rng.randrange(8, 40),
        max_num_seqs=rng.randrange(2, 8),
        max_model_len=64,
    )
    aborted: set[str] = set()
    for _ in range(300):
        if len(h.requests) < 60 and rng.random() < 0.4:
            h.add(
                f"r{len(h.requests)}",
                rng.randrange(0 if rng.random() < 0.05 else 1, 40),
                max_tokens=rng.randrange(1, 30),
                priority=rng.randrange(3),
            )
        if h.requests and rng.random() < 0.04:
            rid = rng.choice(list(h.requests))
            if not h.requests[rid].is_finished:
                aborted.add(rid)
            h.abort(rid)
        out = h.schedule()
        if out.chunks and rng.random() < 0.02:  # abort something between schedule and update
            rid = rng.choice(out.chunks).request_id
            aborted.add(rid)
            h.abort(rid)
        h.update(out)
    h.run()
    for rid, request in h.requests.items():
        if rid in aborted or request.error is not None:
            assert request.finish_reason is FinishReason.ABORT
            continue
        assert request.finish_reason is FinishReason.LENGTH
        assert request.output_token_ids == reference_output(
            request.prompt_token_ids, request.seed, request.params.max_tokens
        )


# ------------------------------------------------------------------------ step budget


def test_memory_budget_bounds_every_chunk_and_shrinks_them_as_the_context_grows() -> None:
    # bytes = 10 per padded row + 1 per (row, context position): the indexer's [T, J] term.
    memory = LinearCost((0.0, 0.0, 10.0, 1.0, 0.0))
    h = Harness(budget=256, step_budget=StepBudget(memory, 2000.0))
    h.add("long", 200, max_tokens=2)
    h.run()
    chunks = chunks_of(h, "long")
    assert [n for _, n in chunks][:3] == [40, 26, 20]  # the largest that fit, context growing
    assert sum(n for _, n in chunks[:-1]) == 200  # every prompt position once
    assert all(memory(out.shape) <= 2000 for out in h.outputs)
    assert h.requests["long"].output_token_ids == reference_output(
        h.requests["long"].prompt_token_ids, h.requests["long"].seed, 2
    )


def test_memory_budget_counts_the_padding_of_decode_rows() -> None:
    memory = LinearCost((0.0, 0.0, 10.0, 1.0, 0.0))
    h = Harness(budget=256, step_budget=StepBudget(memory, 4000.0))
    for rid in ("a", "b", "c"):
        h.add(rid, 3, max_tokens=50)
    h.step()
    h.add("long", 100, max_tokens=1)
    h.step()  # three decode rows + a chunk: the batch is padded to 4 rows of the chunk
    (start, length), *_ = chunks_of(h, "long")
    assert start == 0 and 4 * length * 10 + 4 * length * length <= 4000
    assert 4 * (length + 1) * 10 + 4 * (length + 1) ** 2 > 4000
    h.run()
    assert all(memory(out.shape) <= 4000 for out in h.outputs)


def test_a_prompt_that_can_never_fit_the_memory_budget_is_rejected() -> None:
    memory = LinearCost((100.0, 0.0, 10.0, 1.0, 1.0))
    budget = StepBudget(memory, 1000.0)
    assert budget.max_context_len() == (1000 - 100 - 10) // 2
    h = Harness(budget=64, max_model_len=1024, num_blocks=256, step_budget=budget)
    h.add("huge", 500, max_tokens=1)
    h.add("small", 5, max_tokens=2)
    h.run()
    assert h.requests["huge"].finish_reason is FinishReason.ABORT
    assert "activation memory budget" in h.deltas["huge"][-1].error
    assert h.requests["small"].finish_reason is FinishReason.LENGTH


def test_time_budget_sizes_chunks_to_the_target_step_time() -> None:
    # 10 ms per step + 1 ms per row + 10 µs per (row, context position).
    cost = LinearCost((0.01, 0.0, 1e-3, 1e-5, 0.0))
    model = StepTimeModel(cost, prior_weight=1e6)  # held at the prior: a known model
    h = Harness(
        budget=256,
        max_model_len=1024,
        num_blocks=256,
        step_budget=StepBudget(time_model=model, target_step_s=0.1),
    )
    h.add("long", 600, max_tokens=1)
    h.run()
    lengths = [n for _, n in chunks_of(h, "long")]
    assert lengths[0] == 57  # 10 ms + 57 ms + 57 · 57 · 10 µs <= 0.1 s (58 would not fit)
    assert all(cost(out.shape) <= 0.1 for out in h.outputs if out.shape.max_new_tokens > 1)
    assert lengths == sorted(lengths, reverse=True)  # later chunks see more context


def test_a_spent_step_budget_defers_a_second_chunk_but_never_a_decode_row() -> None:
    budget = StepBudget(LinearCost((0.0, 0.0, 1.0, 0.0, 0.0)), 10.0)
    assert budget.max_chunk(StepShape(), 0, 50) == 10
    assert budget.max_chunk(StepShape(num_seqs=12, max_new_tokens=1, max_context=5), 7, 1) == 1
    assert budget.max_chunk(StepShape(num_seqs=12, max_new_tokens=1, max_context=5), 7, 30) == 1
    assert budget.max_chunk(StepShape(num_seqs=1, max_new_tokens=10, max_context=10), 0, 30) == 0


def test_decode_rows_that_run_apart_are_priced_unpadded() -> None:
    # 100 decode rows and a prompt of 500: where they share one padded forward, each row pads
    # to the chunk (101 rows of n <= 10,000 bytes: n = 99); where the decode rows run apart
    # (step graphs), the chunk adds its own rows only.
    memory = LinearCost((0.0, 0.0, 1.0, 0.0, 0.0))  # a byte per padded row
    decode_rows = StepShape(num_seqs=100, max_new_tokens=1, max_context=50, num_apart=100)
    assert StepBudget(memory, 10_000.0).max_chunk(decode_rows, 0, 500) == 99
    apart = StepBudget(memory, 10_000.0, decode_rows_apart=True)
    assert apart.max_chunk(decode_rows, 0, 500) == 500


def test_a_step_reports_its_leading_decode_rows_to_the_step_budget() -> None:
    # Three requests decode while a fourth prompt arrives: the mixed step's shape (what the
    # budget prices and the time model observes) counts its three leading one-token rows, as
    # does the plan the budget sized the chunk against.
    seen: list[StepShape] = []

    class Recording(StepBudget):
        def max_chunk(self, shape, start_position, num_wanted):
            seen.append(shape)
            return super().max_chunk(shape, start_position, num_wanted)

    h = Harness(budget=64, step_budget=Recording(decode_rows_apart=True))
    for rid in ("a", "b", "c"):
        h.add(rid, 5, max_tokens=6)
    h.step()
    h.add("d", 40, max_tokens=2)
    seen.clear()
    mixed = h.step()
    assert [len(c.token_ids) for c in mixed.chunks] == [1, 1, 1, 40]
    assert mixed.shape == StepShape(4, 40, mixed.shape.max_context, num_apart=3)
    assert seen and seen[-1].num_apart == 3 and seen[-1].num_seqs == 3
    h.run()


def test_time_model_learns_the_step_cost_from_observed_steps() -> None:
    truth = LinearCost((0.05, 0.004, 5e-4, 6e-7, 1e-5))
    model = StepTimeModel(LinearCost((0.3, 0.02, 3e-3, 3e-6, 3e-5)))
    rng = random.Random(0)
    for _ in range(300):
        shape = StepShape(rng.randint(1, 16), rng.choice([1, 1, 8, 64, 512]), rng.randint(1, 8192))
        model.observe(shape, truth(shape))
    for shape in (StepShape(1, 1, 100), StepShape(8, 1, 4000), StepShape(1, 512, 8000)):
        assert model.predict(shape) == pytest.approx(truth(shape), rel=0.15)
