"""Resume slots (`cache.md` §3): the pool's budget, LRU, references and checksums; the scheduler
with a fake runner whose slot state a restore must really bring back; and the engine on the
`tiny` model, where a conversation resumed from slots gives the tokens of the uncached engine."""

from __future__ import annotations

import asyncio
import pickle
import random
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.async_engine import AsyncEngine, EngineConfig
from engine.kv_cache.resume import ResumeSlots, ResumeTier
from engine.models import preset_config
from engine.models.deepseek_v41.random_init import random_model
from engine.models.deepseek_v41.state import export_slot, import_slot, slot_payload_len
from engine.outputs import SchedulerOutput
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.engine.engine_checks import assert_all_released
from tests.engine.test_prefix_cache import CachingHarness, ReplayingFakeRunner
from tests.engine.test_scheduler import BLOCK_TOKENS, reference_output

# ---------------------------------------------------------------------------- the pool


class BytesPayload:
    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)
        self.landed = True  # False: stands for a device → host copy still running

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def checksum(self) -> int:
        return zlib.crc32(self.data)

    def is_ready(self) -> bool:
        return self.landed


def publish(pool: ResumeSlots, key: int, tail: list[int], size: int = 100):
    payload = BytesPayload(bytes([key]) * size)
    return pool.publish(bytes([key]) * 32, 128, tail, payload, payload.checksum())


def test_lookup_takes_the_longest_tail_the_tokens_extend() -> None:
    pool = ResumeSlots(1000)
    short, long_ = publish(pool, 1, [5, 6]), publish(pool, 1, [5, 6, 7, 8])
    publish(pool, 1, [5, 9, 9])
    key = bytes([1]) * 32
    assert pool.lookup(key, [5, 6, 7, 8, 1], 10) == [long_, short]
    assert pool.lookup(key, [5, 6, 7, 8], 3) == [short]  # one token must be left to compute
    assert pool.lookup(key, [4], 10) == [] and pool.lookup(bytes([2]) * 32, [5, 6], 10) == []
    assert long_.length == 132
    pool.check_integrity()


def test_budget_evicts_least_recently_used_unreferenced_slots() -> None:
    pool = ResumeSlots(250)
    a, b = publish(pool, 1, [1]), publish(pool, 2, [2])
    assert pool.verify(a)  # a is now the most recent
    c = publish(pool, 3, [3])  # needs room: b is the least recently used
    assert [s.slot_id for s in pool.slots()] == [a.slot_id, c.slot_id] and b not in pool.slots()
    pool.lock(a)
    assert publish(pool, 4, [4], size=200) is None  # a is referenced: evicting c is not enough
    assert [s.slot_id for s in pool.slots()] == [a.slot_id, c.slot_id]  # nothing evicted
    assert publish(pool, 5, [5], size=300) is None  # larger than the budget
    pool.unlock(a)
    assert publish(pool, 4, [4], size=200) is not None
    stats = pool.stats()
    assert (stats.num_evicted, stats.num_refused, stats.num_slots) == (3, 2, 1)
    assert stats.num_bytes == 200 <= stats.max_bytes
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.unlock(a)


def test_a_corrupt_slot_fails_verification_and_is_dropped() -> None:
    pool = ResumeSlots(1000)
    slot = publish(pool, 1, [1, 2])
    slot.payload.data[7] ^= 1
    assert not pool.verify(slot)
    assert pool.lookup(bytes([1]) * 32, [1, 2, 3], 5) == []
    assert pool.stats().num_corrupt == 1 and len(pool) == 0
    pool.check_integrity()


def test_a_slot_published_before_its_copy_landed_is_sealed_later() -> None:
    """On CUDA a finish does not wait for the device → host copy: the checksum is taken at
    the first `seal` after the copy landed, and corruption after that is still caught."""
    pool = ResumeSlots(1000)
    payload = BytesPayload(b"x" * 100)
    payload.landed = False
    slot = pool.publish(bytes([1]) * 32, 0, [1], payload, None)
    pool.seal()
    assert slot.checksum is None
    payload.landed = True
    pool.seal()
    assert slot.checksum == zlib.crc32(b"x" * 100)
    pool.check_integrity()
    payload.data[3] ^= 1
    assert not pool.verify(slot) and len(pool) == 0


def test_a_republished_sequence_replaces_its_older_slot() -> None:
    pool = ResumeSlots(1000)
    old = publish(pool, 1, [1, 2])
    new = publish(pool, 1, [1, 2])
    assert [s.slot_id for s in pool.slots()] == [new.slot_id] and new.generation > old.generation


# ---------------------------------------------------------------------------- scheduler


class FakeSlotPayloads:
    """Snapshots of the fake runner: its slot's position and the tail block's rows (the fake
    model reads every position's token from the pool, so a missing restore is wrong output)."""

    def __init__(self, runner: ReplayingFakeRunner) -> None:
        self.runner = runner

    def export(self, slot: int, tail_block: int | None) -> BytesPayload:
        bt = self.runner.cache.block_tokens
        rows = (
            {}
            if tail_block is None
            else {
                r: self.runner.pool[(tail_block, r)]
                for r in range(bt)
                if (tail_block, r) in self.runner.pool
            }
        )
        return BytesPayload(pickle.dumps((self.runner.slot_state[slot][1], rows)))


class ResumingFakeRunner(ReplayingFakeRunner):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.num_resumes = 0

    def execute(self, out: SchedulerOutput):
        for chunk in out.chunks:
            if chunk.resume is None:
                continue
            position, rows = pickle.loads(bytes(chunk.resume.payload.data))
            assert position == chunk.start_position, "slot restored at another position"
            self.slot_state[chunk.slot] = (chunk.request_id, position)
            for row, token in rows.items():
                self.pool[(chunk.resume.tail_block, row)] = token
            self.num_resumes += 1
        return super().execute(out)


class ResumingHarness(CachingHarness):
    def __init__(self, *, resume_bytes: int = 1 << 20, **kwargs) -> None:
        super().__init__(**kwargs)
        self.runner = ResumingFakeRunner(self.cache, self.requests)
        self.pool = ResumeSlots(resume_bytes)
        reuse = self.scheduler.prefix_reuse
        reuse.resume = ResumeTier(self.pool, FakeSlotPayloads(self.runner), BLOCK_TOKENS)

    def check_all_finished(self) -> None:
        super().check_all_finished()
        self.pool.check_integrity()
        assert all(s.num_refs == 0 for s in self.pool.slots())


def test_next_turn_resumes_from_the_slot_and_computes_only_new_tokens() -> None:
    h = ResumingHarness(budget=64, replay_tokens=8)
    prompt = list(range(1, 23))  # 5 blocks of 4 + 2
    h.add("a", prompt, seed=3, max_tokens=5)
    h.run()
    # a computed 22 + 4 = 26 positions: slot at L = 26, P0 = 24, tail [24, 26).
    follow = h.requests["a"].all_token_ids + [77, 78, 79]
    h.add("b", follow, seed=3, max_tokens=4)
    h.run()
    first = next(c for o in h.outputs for c in o.chunks if c.request_id == "b")
    assert first.resume is not None and first.start_position == 26 and first.restore is None
    assert h.requests["b"].num_cached_tokens == 26
    assert h.requests["b"].output_token_ids == reference_output(follow, 3, 4)
    assert h.runner.num_resumes == 1
    stats = h.pool.stats()
    assert (stats.num_hits, stats.num_misses, stats.num_slots) == (1, 1, 2)


def test_a_slot_is_not_used_for_a_prompt_that_diverges_inside_its_tail() -> None:
    h = ResumingHarness(budget=64, replay_tokens=8)
    h.add("a", list(range(1, 23)), seed=3, max_tokens=5)
    h.run()
    tokens = h.requests["a"].all_token_ids
    follow = tokens[:25] + [tokens[25] % 900 + 1, 77]  # position 25 differs
    h.add("b", follow, seed=3, max_tokens=4)
    h.run()
    assert h.runner.num_resumes == 0 and h.requests["b"].num_cached_tokens == 24
    assert h.requests["b"].output_token_ids == reference_output(follow, 3, 4)


def test_aborted_and_preempted_requests_free_their_slot_references() -> None:
    h = ResumingHarness(budget=64, replay_tokens=8)
    h.add("a", list(range(1, 23)), seed=3, max_tokens=5)
    h.run()
    follow = h.requests["a"].all_token_ids + [77]
    h.add("b", follow, seed=3, max_tokens=4)
    out = h.schedule()  # admitted from the slot; the restore is scheduled, not yet applied
    (slot,) = [s for s in h.pool.slots() if s.num_refs]
    assert any(c.resume is not None for c in out.chunks)
    h.abort("b")
    assert slot.num_refs == 0 and h.requests["b"].finish_reason is FinishReason.ABORT
    h.update(out)  # the aborted request's chunk is ignored
    h.run()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_randomized_turns_with_preemption_and_aborts_keep_outputs_and_references(seed) -> None:
    """Conversations whose turns extend earlier turns, in tight pools (preemption, block and
    slot eviction) with aborts: every output equals the uncached reference, and at the end no
    slot is referenced."""
    rng = random.Random(seed)
    h = ResumingHarness(
        num_blocks=rng.randrange(12, 24),
        num_slots=rng.randrange(2, 5),
        budget=rng.randrange(8, 40),
        max_num_seqs=rng.randrange(2, 5),
        max_model_len=80,
        replay_tokens=rng.choice([4, 8]),
        resume_bytes=rng.choice([300, 2000, 1 << 20]),
    )
    # Each conversation's next turn extends its latest request's tokens so far (prompt +
    # outputs once it finished: then its slot can serve; earlier, only blocks can).
    latest = [h.add(f"first{c}", rng.randrange(3, 12), max_tokens=3, seed=7) for c in range(3)]
    for _ in range(150):
        if len(h.requests) < 30 and rng.random() < 0.3:
            conv = rng.randrange(len(latest))
            new = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
            prompt = latest[conv].all_token_ids + new
            if len(prompt) < 60:
                latest[conv] = h.add(
                    f"r{len(h.requests)}", prompt, max_tokens=rng.randrange(1, 8), seed=7
                )
        h.maybe_abort(rng)
        h.step()
    h.run()
    h.check_outputs_equal_the_reference()


# ---------------------------------------------------------------------------- the model


def test_export_and_import_of_a_slot_round_trip(tiny_model) -> None:
    state = tiny_model.allocate_state(2, 4)
    for tensor in [*state.swa, *state.pending.values(), state.tokens, *state.global_kv.values()]:
        tensor.copy_(torch.randint(0, 100, tensor.shape).to(tensor.dtype))
    payload = export_slot(state, 1, 2)
    assert payload.numel() == slot_payload_len(state)
    import_slot(state, 0, 3, payload)
    for ring in state.swa:
        assert torch.equal(ring[0], ring[1])
    for source in state.global_kv:
        assert torch.equal(state.global_kv[source][3], state.global_kv[source][2])
    assert torch.equal(state.tokens[0], state.tokens[1])
    with pytest.raises(ValueError):
        import_slot(state, 0, None, payload)  # a payload with a tail needs a tail block


# ---------------------------------------------------------------------------- the engine


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


async def _generate(engine: AsyncEngine, prompt: list[int], params, rid: str) -> tuple:
    tokens, cached = [], None
    async for delta in engine.generate(prompt, params, rid):
        tokens.extend(delta.token_ids)
        cached = delta.num_cached_tokens
    return tokens, cached


NEW_TOKENS = (150, 40, 300)  # per turn after the first: one shorter than a block


async def _conversation(engines, first: list[int], params, *, between=None) -> list[list]:
    """4 turns: each prompt is the previous prompt + the first engine's answer + new tokens
    (at the token level, as an agent resends its history)."""
    for engine in engines:
        await engine.start()
    try:
        prompt, results = first, []
        for turn in range(len(NEW_TOKENS) + 1):
            if between is not None and turn:
                between(turn)
            outs = [await _generate(e, prompt, params, f"t{turn}") for e in engines]
            results.append(outs)
            if turn < len(NEW_TOKENS):
                prompt = prompt + outs[0][0] + _tokens(NEW_TOKENS[turn], seed=20 + turn)
        return results
    finally:
        for engine in engines:
            await engine.shutdown()


def _engine(model, **overrides) -> AsyncEngine:
    config = EngineConfig(model="tiny", max_num_seqs=4, kv_cache_tokens=8192, **overrides)
    return AsyncEngine.from_model(model, config)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def wide_window_model():
    """`tiny` with 64-token windows over 8 layers: a bounded replay (128 rows) is approximate
    there, so only a resume makes the cached turns exact."""
    cfg = preset_config("tiny", sliding_window=64)
    return random_model(cfg, "cpu", torch.float32, quantized_experts=False, seed=4)


@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_resumed_conversation_equals_the_uncached_engine(
    which, tiny_model_exact_kv, wide_window_model
) -> None:
    model = tiny_model_exact_kv if which == "tiny" else wide_window_model
    on, off = _engine(model, swa_replay="bounded"), _engine(model, enable_prefix_caching=False)
    engines = [on, off]
    if which == "wide":  # the same cache with block hits only: bounded replay drifts here
        engines.append(_engine(model, swa_replay="bounded", resume_slot_memory=0))
    results = asyncio.run(_conversation(engines, _tokens(200, seed=5), GREEDY))
    assert [r[0][0] for r in results] == [r[1][0] for r in results]
    if which == "wide":
        assert [r[2][0] for r in results] != [r[1][0] for r in results]
    # Turn k's slot stands at L = its prompt + 7 outputs (the 8th is not computed).
    lengths = [200 + 7]
    for new in NEW_TOKENS[:-1]:
        lengths.append(lengths[-1] + 1 + new + 7)
    assert [r[0][1] for r in results] == [0, *lengths]
    assert all(r[1][1] == 0 for r in results)
    reuse = on.core.scheduler.prefix_reuse
    stats, pool = reuse.stats(), reuse.resume.pool.stats()
    assert (pool.num_hits, pool.num_misses, pool.num_published) == (3, 1, 4)
    assert stats.num_replayed_tokens == 0 and stats.num_hit_tokens == sum(lengths)
    assert stats.hit_tokens_by_tier["resume"] == sum(n % 128 for n in lengths)
    assert_all_released(on)
    assert all(s.num_refs == 0 for s in reuse.resume.pool.slots())


def test_a_corrupt_slot_is_a_miss_and_the_output_stays_exact(tiny_model_exact_kv) -> None:
    on = _engine(tiny_model_exact_kv, swa_replay="exact")
    off = _engine(tiny_model_exact_kv, enable_prefix_caching=False)
    pool = on.core.scheduler.prefix_reuse.resume.pool

    def corrupt(turn: int) -> None:
        if turn == 2:
            for slot in pool.slots():
                slot.payload.buffer[slot.nbytes // 2] ^= 0x10

    results = asyncio.run(_conversation([on, off], _tokens(200, seed=6), GREEDY, between=corrupt))
    assert [r[0][0] for r in results] == [r[1][0] for r in results]
    cached = [r[0][1] for r in results]
    assert cached[2] % 128 == 0 and cached[1] % 128 != 0 and cached[3] % 128 != 0
    stats = pool.stats()
    assert (stats.num_corrupt, stats.num_hits, stats.num_misses) == (2, 2, 2)


def test_the_memory_budget_evicts_the_least_recent_conversation(tiny_model_exact_kv) -> None:
    per_slot = slot_payload_len(tiny_model_exact_kv.allocate_state(1, 1))
    engine = _engine(tiny_model_exact_kv, resume_slot_memory=per_slot + per_slot // 2)
    prompts = {c: _tokens(200, seed=30 + i) for i, c in enumerate("ab")}

    async def run() -> dict:
        await engine.start()
        try:
            first = {c: await _generate(engine, p, GREEDY, f"{c}1") for c, p in prompts.items()}
            out = {}
            for c in "ba":  # a's slot was evicted by b's
                follow = prompts[c] + first[c][0] + _tokens(30, seed=40)
                out[c] = await _generate(engine, follow, GREEDY, f"{c}2")
            return out
        finally:
            await engine.shutdown()

    out = asyncio.run(run())
    assert out["b"][1] == 207 and out["a"][1] == 128
    stats = engine.core.scheduler.prefix_reuse.resume.pool.stats()
    assert stats.num_evicted >= 2 and stats.num_bytes <= stats.max_bytes and stats.num_hits == 1
    assert_all_released(engine)


@pytest.mark.gpu
def test_cuda_conversation_resumes_from_pinned_slots(tiny_checkpoint) -> None:
    """On CUDA the snapshot is a non-blocking copy into pinned memory (its CRC waits for it):
    the turns resume, and with exact KV storage answer what the uncached engine answers."""
    from engine.models import Numerics, load_model

    model = load_model(tiny_checkpoint, device="cuda", numerics=Numerics(kv_quantize=False))
    config = {"device": "cuda", "max_model_len": 2048, "cuda_graphs": False}
    on = _engine(model, **config)
    off = _engine(model, enable_prefix_caching=False, **config)
    results = asyncio.run(_conversation([on, off], _tokens(200, seed=5), GREEDY))
    assert [r[0][1] for r in results][1] == 207
    assert on.core.scheduler.prefix_reuse.resume.pool.stats().num_hits == 3
    assert [r[0][0] for r in results] == [r[1][0] for r in results]
    slot = next(on.core.scheduler.prefix_reuse.resume.pool.slots())
    assert slot.payload.buffer.is_pinned()
    assert_all_released(on)
