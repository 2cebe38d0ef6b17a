"""The engine's per-row host fast paths keep their behaviour (issue 17: host time per step).

Decode rows skip the step budget and allocate only across a block boundary; block-table
snapshots are shared until a table grows; the runner's block-table rows and the sampler's
per-params row cache give the batches of a fresh build; pinned staging buffers are reused only
after their copy's event completed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_cache import CacheConfig, KVCacheManager
from engine.model_runner import ModelRunner, split_decode_rows
from engine.models.deepseek_v41.state import PinnedStaging
from engine.outputs import ModelOutput, SamplingInfo, ScheduledChunk, SchedulerOutput
from engine.request import Request
from engine.sampler import SamplingBatch, SamplingRowCache
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_budget import LinearCost, StepBudget

BLOCK = 4


def _scheduler(step_budget: StepBudget | None = None, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(CacheConfig(num_blocks=64, num_slots=16, block_tokens=BLOCK))
    config = SchedulerConfig(max_model_len=128, max_num_batched_tokens=budget, max_num_seqs=16)
    return Scheduler(config, kv, step_budget)


def _add(scheduler: Scheduler, rid: str, prompt_len: int, max_tokens: int = 40) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = Request(rid, list(range(1, prompt_len + 1)), params, seed=0, arrival_time=0.0)
    scheduler.add_request(request)
    return request


def _step(scheduler: Scheduler, token: int = 5) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = {c.request_id: [token] for c in out.chunks if c.sampling is not None}
    scheduler.update(out, ModelOutput(sampled=sampled, logprobs={}))
    scheduler.check_integrity()
    return out


def test_a_decode_row_crossing_a_block_boundary_allocates_exactly_then() -> None:
    scheduler = _scheduler()
    _add(scheduler, "a", prompt_len=3)
    tables = []
    for _ in range(8):
        out = _step(scheduler)
        (chunk,) = out.chunks
        end = chunk.start_position + len(chunk.token_ids)
        assert len(chunk.block_table) == -(-end // BLOCK)  # just enough blocks, never fewer
        tables.append(chunk.block_table)
    # Positions 0..2 (prefill), then one row per step at 3, 4, ... 9: a new block at 4 and 8.
    assert [len(t) for t in tables] == [1, 1, 2, 2, 2, 2, 3, 3]
    # Between boundaries the scheduler hands out the very same snapshot.
    assert tables[2] is tables[3] is tables[4] is tables[5]
    assert tables[6][:2] == tables[5]


def _until_decoding(scheduler: Scheduler, num_requests: int) -> SchedulerOutput:
    for _ in range(50):
        out = _step(scheduler)
        if len(out.chunks) == num_requests and all(len(c.token_ids) == 1 for c in out.chunks):
            return out
    raise AssertionError("the requests never all decoded")


@pytest.mark.parametrize("memory_bytes", [10.0, 40.0])
def test_decode_rows_never_wait_for_the_step_budget_but_prefill_chunks_do(memory_bytes) -> None:
    # The step's padded rows (sequences x longest chunk) must stay within memory_bytes.
    budget = StepBudget(LinearCost((0.0, 0.0, 1.0, 0.0, 0.0)), memory_bytes)
    scheduler = _scheduler(budget, budget=64)
    for i in range(12):
        _add(scheduler, f"d{i}", prompt_len=2)
    _until_decoding(scheduler, 12)
    _add(scheduler, "long", prompt_len=30)
    out = _step(scheduler)
    decode = [c for c in out.chunks if c.request_id != "long"]
    (long,) = [c for c in out.chunks if c.request_id == "long"]
    assert len(decode) == 12 and all(len(c.token_ids) == 1 for c in decode)  # 12 rows > 10
    # 13 sequences: 3 positions fit 40 (39), 4 would not; with 10 even one does not fit, and
    # the first chunk of a step without a multi-token chunk still progresses by one.
    assert len(long.token_ids) == (3 if memory_bytes == 40.0 else 1)


def test_a_preemption_drops_the_victim_from_the_step_shape() -> None:
    # Room for 3 blocks of 4 positions: two requests decoding past 4 positions cannot both grow.
    kv = KVCacheManager(CacheConfig(num_blocks=3, num_slots=4, block_tokens=BLOCK))
    config = SchedulerConfig(max_model_len=12, max_num_batched_tokens=16, max_num_seqs=4)
    scheduler = Scheduler(config, kv)
    _add(scheduler, "a", prompt_len=3, max_tokens=8)
    _add(scheduler, "b", prompt_len=3, max_tokens=8)
    preempted = False
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        before = scheduler.num_preemptions
        out = _step(scheduler)
        assert out.num_tokens == sum(len(c.token_ids) for c in out.chunks)
        assert len(out.chunks) <= 2
        preempted = preempted or scheduler.num_preemptions > before
    assert preempted and not scheduler.has_unfinished_requests()


def test_block_table_snapshots_are_shared_until_the_table_grows() -> None:
    kv = KVCacheManager(CacheConfig(num_blocks=8, num_slots=2, block_tokens=BLOCK))
    assert kv.allocate("a", 3)
    first = kv.block_table("a")
    assert kv.allocate("a", 4)  # same block
    assert kv.block_table("a") is first
    assert kv.allocate("a", 5)  # a second block
    grown = kv.block_table("a")
    assert grown is not first and grown[:1] == first and len(grown) == 2
    kv.check_integrity()
    kv.free("a")
    assert kv.block_table("a") == ()
    assert kv.allocate("a", 1)
    assert len(kv.block_table("a")) == 1
    kv.check_integrity()


def _chunk(rid: str, slot: int, table: tuple[int, ...], start: int = 8) -> ScheduledChunk:
    info = SamplingInfo(SamplingParams(temperature=0.0), 0, 0, start)
    return ScheduledChunk(rid, slot, table, start, (3,), info)


def test_block_table_rows_follow_slot_reuse_and_growth(tiny_model) -> None:
    runner = ModelRunner(tiny_model, num_slots=4, num_blocks=32)

    def tables(*chunks: ScheduledChunk) -> list[list[int]]:
        out = SchedulerOutput(chunks=chunks, num_tokens=len(chunks))
        return runner.build_batch(out).block_tables.tolist()

    assert tables(_chunk("a", 0, (4, 5, 6)), _chunk("b", 1, (7,))) == [[4, 5, 6], [7, -1, -1]]
    # Slot 0 reused by a request with a shorter table: the old entries are gone.
    assert tables(_chunk("c", 0, (9,)), _chunk("b", 1, (7,))) == [[9], [7]]
    wide = tuple(range(10, 30))  # wider than the mirror's first width
    assert tables(_chunk("b", 1, (7, 8)), _chunk("c", 0, wide)) == [
        [7, 8, *[-1] * 18],
        list(wide),
    ]


def _batch_fields(batch: SamplingBatch) -> dict:
    out = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        elif dataclasses.is_dataclass(value):
            value = _batch_fields(value)
        out[field.name] = value
    return out


def test_the_row_cache_gives_the_batch_of_a_fresh_build() -> None:
    greedy = SamplingParams(temperature=0.0)
    nucleus = SamplingParams(temperature=0.7, top_p=0.9, logprobs=True, top_logprobs=2)
    early = SamplingParams(temperature=1.0, top_k=5, min_tokens=3, stop_token_ids=(4,))
    biased = SamplingParams(temperature=0.5, logit_bias={3: 1.5}, min_p=0.1)
    cache = SamplingRowCache()
    steps = [
        [greedy, nucleus, early, biased],
        [greedy, nucleus, early, biased],  # the same objects, one output later
        [SamplingParams(temperature=0.0, top_k=2, logprobs=True), nucleus, early],  # a new one
    ]
    for index, params in enumerate(steps):
        infos = [SamplingInfo(p, seed=i, output_index=index + i, num_prompt_tokens=5) for i, p in
                 enumerate(params)]  # fmt: skip
        cached = SamplingBatch.from_infos(infos, 50, "cpu", eos_token_id=1, rows_cache=cache)
        fresh = SamplingBatch.from_infos(infos, 50, "cpu", eos_token_id=1)
        assert _batch_fields(cached) == _batch_fields(fresh)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad = SamplingParams(logit_bias={60: 1.0})
        SamplingBatch.from_infos([SamplingInfo(bad, 0, 0, 1)], 50, "cpu", rows_cache=cache)


class _Event:
    """A copy's completion, set by the test."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_staging_buffer_is_reused_only_after_its_copy_completed() -> None:
    events: list[_Event] = []
    copies: list[torch.Tensor] = []  # what each "device copy" reads: the staging view itself

    def record() -> _Event:
        events.append(_Event())
        return events[-1]

    def copy(staged: torch.Tensor, device: torch.device) -> torch.Tensor:
        copies.append(staged)
        return staged.clone()

    staging = PinnedStaging(lambda n: torch.empty(n, dtype=torch.long), copy, record)
    cpu = torch.device("cpu")
    staging.upload(torch.tensor([1, 2, 3]), cpu)
    staging.upload(torch.tensor([4, 5, 6]), cpu)  # the first copy has not run: a new buffer
    assert copies[0].data_ptr() != copies[1].data_ptr()
    assert copies[0].tolist() == [1, 2, 3]  # not overwritten while its copy is pending
    events[0].done = True
    out = staging.upload(torch.tensor([[7, 8]]), cpu)
    assert copies[2].data_ptr() == copies[0].data_ptr()  # now reused
    assert out.tolist() == [[7, 8]]
    assert copies[1].tolist() == [4, 5, 6]  # still pending: untouched


@pytest.mark.gpu
def test_ints_to_device_through_reused_staging_keeps_every_copy() -> None:
    from engine.models.deepseek_v41.state import ints_to_device

    device = torch.device("cuda")
    slow = torch.randn(4096, 4096, device=device)
    outs = []
    for i in range(200):
        slow = slow @ slow.T / 4096  # keeps the stream busy while the host refills buffers
        outs.append(ints_to_device([i, i + 1, i + 2] * (1 + i % 50), device))
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert out.tolist() == [i, i + 1, i + 2] * (1 + i % 50)


def test_a_mixed_step_splits_into_its_decode_rows_then_the_rest() -> None:
    def chunk(rid: str, n: int) -> ScheduledChunk:
        return ScheduledChunk(rid, 0, (0,), 5, tuple(range(n)), None)

    mixed = SchedulerOutput((chunk("a", 1), chunk("b", 1), chunk("c", 7), chunk("d", 1)), 10)
    decode, rest = split_decode_rows(mixed)
    assert [c.request_id for c in decode.chunks] == ["a", "b"] and decode.num_tokens == 2
    assert [c.request_id for c in rest.chunks] == ["c", "d"] and rest.num_tokens == 8
    for alone in (SchedulerOutput(mixed.chunks[:2], 2), SchedulerOutput(mixed.chunks[2:3], 7)):
        assert split_decode_rows(alone) == (alone,)
