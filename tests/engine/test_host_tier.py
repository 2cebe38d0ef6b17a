"""The host tier of the prefix cache (`cache.md` §2.3, §2.8): the pool's contract, the
scheduler with a GPU pool too small for its working set (blocks evicted from the GPU hit in the
host tier, restored into the request's blocks before its first step), corrupt slots, and the
`tiny` engine giving the cache-off output from host hits (exact replay)."""

from __future__ import annotations

import asyncio
import random
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.async_engine import AsyncEngine, EngineConfig
from engine.kv_cache import KVCacheManager, PrefixCache
from engine.kv_cache.hashing import chain_keys, chain_seed, combine_salts
from engine.kv_cache.host import DONE, HostBlockPool, HostPoolConfig
from engine.kv_cache.reuse import HostTier, PrefixReuse, PrefixReuseConfig
from engine.kv_cache.store.format import padded_len
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from tests.engine.engine_checks import assert_all_released
from tests.engine.test_prefix_cache import (
    FINGERPRINT,
    CachingHarness,
    run_random_shared_prefix_schedule,
)
from tests.engine.test_scheduler import BLOCK_TOKENS, reference_output

# ---------------------------------------------------------------------------- the pool


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _pool(num_slots: int, payload_len: int = 64) -> HostBlockPool:
    return HostBlockPool(HostPoolConfig(num_slots * padded_len(payload_len), payload_len))


def _fill(values: list[int]):
    """A copy callback writing byte `values[i]` into the slot of the i-th key."""

    def copy(indices: list[int], slots: list[torch.Tensor]):
        for i, slot in zip(indices, slots, strict=True):
            slot.fill_(values[i])
        return DONE

    return copy


class _Handle:
    def __init__(self) -> None:
        self.done = False

    def is_done(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.done = True


def test_pool_holds_payloads_lru_with_leaves_evicted_first_within_budget() -> None:
    pool = _pool(4)
    pool.put([_key(0), _key(1), _key(2)], _fill([10, 11, 12]), "gpu")  # one chain
    pool.check_integrity()
    assert pool.match([_key(0), _key(1), _key(2), _key(3)]) == 3
    assert [int(v[0]) for v in pool.read([_key(0), _key(1)])] == [10, 11]
    pool.put([_key(5), _key(6)], _fill([15, 16]), "gpu")  # full: evicts the oldest, a leaf
    pool.check_integrity()
    assert pool.match([_key(0), _key(1), _key(2)]) == 2  # block 2 went, its parents stayed
    stats = pool.stats()
    assert stats.num_blocks == 4 and stats.num_evicted == 1
    assert stats.num_bytes <= stats.capacity_bytes
    assert stats.copied_bytes == {"gpu->host": 5 * 64}
    assert pool.payload(_key(5)) == bytes([15]) * 64


def test_a_corrupt_slot_is_a_miss_and_is_counted() -> None:
    pool = _pool(4)
    pool.put([_key(0), _key(1), _key(2)], _fill([1, 2, 3]), "gpu")
    view = pool.read([_key(0), _key(1)])[1]
    view[7] ^= 0x40  # a flipped bit in block 1's slot
    assert len(pool.read([_key(0), _key(1), _key(2)])) == 1  # the read stops before it
    assert pool.stats().num_corrupt == 1 and not pool.contains(_key(1))
    assert pool.payload(_key(2)) == bytes([3]) * 64  # other slots are intact
    pool.check_integrity()


def test_filling_and_pinned_slots_are_never_evicted() -> None:
    pool = _pool(2)
    fill = _Handle()
    pool.put([_key(0)], lambda _, slots: fill, "gpu")
    assert pool.match([_key(0)]) == 0 and pool.is_filling(_key(0))
    pool.put([_key(1)], _fill([7]), "gpu")
    views = pool.read([_key(1)])
    copy_out = _Handle()
    pool.pin([_key(1)], copy_out)
    pool.put([_key(2)], _fill([9]), "gpu")  # no slot can be freed: dropped, counted
    assert not pool.contains(_key(2)) and pool.stats().num_dropped == 1
    pool.check_integrity()
    fill.done = copy_out.done = True
    pool.poll()
    assert pool.match([_key(0)]) == 1 and int(views[0][0]) == 7
    pool.put([_key(2)], _fill([9]), "gpu")  # now the LRU one goes
    assert pool.contains(_key(2)) and pool.stats().num_evicted == 1
    pool.check_integrity()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_randomized_pool_operations_keep_integrity_and_bytes(seed: int) -> None:
    """Random puts (some left filling), reads, pins, corruption and polls: integrity after every
    operation; whatever a read returns holds the bytes put for that key; never over budget."""
    rng = random.Random(seed)
    pool = _pool(rng.randrange(1, 8), payload_len=32)
    handles: list[_Handle] = []
    num_flipped = 0
    for _ in range(200):
        op = rng.random()
        if op < 0.4:
            first = rng.randrange(20)
            keys = [_key(first + i) for i in range(rng.randrange(1, 4))]
            values = [(first + i) % 251 for i in range(len(keys))]
            if rng.random() < 0.3:
                handle = _Handle()
                handles.append(handle)

                def copy(indices, slots, values=values, handle=handle):
                    _fill(values)(indices, slots)
                    return handle

                pool.put(keys, copy, "gpu")
            else:
                pool.put(keys, _fill(values), "gpu")
        elif op < 0.7:
            first = rng.randrange(20)
            keys = [_key(first + i) for i in range(rng.randrange(1, 4))]
            views = pool.read(keys)
            for key, view in zip(keys, views, strict=False):
                value = int.from_bytes(key, "little") % 251
                assert bytes(view.numpy()) == bytes([value]) * 32
            if views and rng.random() < 0.5:
                handle = _Handle()
                handles.append(handle)
                pool.pin(keys[: len(views)], handle)
        elif op < 0.75:
            key = _key(rng.randrange(20))
            views = pool.read([key])
            if views:
                views[0][rng.randrange(32)] ^= 1
                num_flipped += 1
                assert pool.read([key]) == [] and not pool.contains(key)
        else:
            for handle in handles:
                if rng.random() < 0.5:
                    handle.done = True
            pool.poll()
        pool.check_integrity()
        assert pool.stats().num_bytes <= pool.config.max_bytes
    for handle in handles:
        handle.done = True
    pool.poll()
    pool.check_integrity()
    assert pool.stats().num_corrupt == num_flipped


# ---------------------------------------------------------------------------- scheduler


class FakeBlockPayloads:
    """The fake runner's pool blocks as payloads: the block's token ids, u32 little-endian."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.payload_len = 4 * BLOCK_TOKENS

    def _encode(self, block: int) -> bytes:
        rows = [self.runner.pool.get((block, r), 0) for r in range(BLOCK_TOKENS)]
        return struct.pack(f"<{BLOCK_TOKENS}I", *rows)

    def save(self, blocks, slots):
        for block, slot in zip(blocks, slots, strict=True):
            slot.copy_(torch.frombuffer(bytearray(self._encode(block)), dtype=torch.uint8))
        return DONE

    def restore(self, slots, blocks):
        for slot, block in zip(slots, blocks, strict=True):
            rows = struct.unpack(f"<{BLOCK_TOKENS}I", bytes(slot.numpy()))
            for r, token in enumerate(rows):
                self.runner.pool[(block, r)] = token
        return DONE

    def export(self, blocks):
        return [self._encode(b) for b in blocks]

    def load(self, blocks, payloads):
        raise AssertionError("no directory tiers here")


class HostHarness(CachingHarness):
    """`CachingHarness` (fake model; every restored position is checked against the request's
    tokens) with a host tier of `num_host_slots` under its GPU pool."""

    def __init__(self, *, num_host_slots: int, replay_tokens: int = 4, **kwargs) -> None:
        super().__init__(replay_tokens=replay_tokens, **kwargs)
        self.kv = KVCacheManager(self.cache, PrefixCache())
        payloads = FakeBlockPayloads(self.runner)
        self.host = HostBlockPool(
            HostPoolConfig(num_host_slots * padded_len(payloads.payload_len), payloads.payload_len)
        )
        config = PrefixReuseConfig(
            fingerprint=FINGERPRINT,
            replay_tokens=replay_tokens,
            num_history_tokens=3,
            block_tokens=BLOCK_TOKENS,
        )
        reuse = PrefixReuse(config, self.kv, host=HostTier(self.host, payloads))
        self.scheduler = Scheduler(self.config, self.kv, prefix_reuse=reuse)

    def step(self):
        out = super().step()
        self.host.check_integrity()
        assert self.host.stats().num_bytes <= self.host.config.max_bytes
        return out

    @property
    def hit_by_tier(self) -> dict[str, int]:
        return self.scheduler.prefix_reuse.stats().hit_tokens_by_tier


def test_blocks_evicted_from_a_small_gpu_pool_hit_in_the_host_tier() -> None:
    h = HostHarness(num_blocks=8, num_host_slots=32, budget=64, max_model_len=32)
    a, b = list(range(1, 23)), list(range(101, 123))  # 5 full blocks of 4 + 2 tokens each
    h.add("a", a, seed=3, max_tokens=4)
    h.run()
    h.add("b", b, seed=3, max_tokens=4)  # needs 7 of the 8 GPU blocks: evicts a's
    h.run()
    h.add("a2", a, seed=3, max_tokens=4)
    h.run()
    assert h.requests["a2"].num_cached_tokens == 20
    assert h.hit_by_tier.get("host", 0) >= 12  # at least 3 of the 5 blocks came from the host
    assert h.requests["a2"].output_token_ids == reference_output(a, 3, 4)
    assert h.runner.num_restores == 1  # the fake runner checked every restored position
    stats = h.host.stats()
    assert stats.num_hits * BLOCK_TOKENS == h.hit_by_tier["host"]
    assert stats.copied_bytes["host->gpu"] == stats.num_hits * 4 * BLOCK_TOKENS


def test_without_the_host_tier_the_same_schedule_recomputes() -> None:
    """The test above can fail: the same schedule with no host tier hits less."""
    h = CachingHarness(num_blocks=8, budget=64, max_model_len=32)
    a, b = list(range(1, 23)), list(range(101, 123))
    for rid, prompt in (("a", a), ("b", b), ("a2", a)):
        h.add(rid, prompt, seed=3, max_tokens=4)
        h.run()
    assert h.requests["a2"].num_cached_tokens < 20


def test_a_corrupt_host_slot_is_a_miss_never_wrong_output() -> None:
    h = HostHarness(num_blocks=8, num_host_slots=32, budget=64, max_model_len=32)
    a, b = list(range(1, 23)), list(range(101, 123))
    for rid, prompt in (("a", a), ("b", b)):
        h.add(rid, prompt, seed=3, max_tokens=4)
        h.run()
    seed = chain_seed(FINGERPRINT, combine_salts(None))
    keys = chain_keys(seed, a, BLOCK_TOKENS)
    gpu_blocks = len(h.kv.prefix_cache.match(keys))
    victim = max(gpu_blocks, 2)  # a block the host tier must serve
    [slot] = h.host.read([keys[victim]])
    slot[5] ^= 0x01  # token 1 of the block changes by 256: wrong KV if it were served
    h.add("a2", a, seed=3, max_tokens=4)
    h.run()  # the fake runner asserts every restored position holds the right token
    assert h.requests["a2"].num_cached_tokens == victim * BLOCK_TOKENS
    assert h.requests["a2"].output_token_ids == reference_output(a, 3, 4)
    assert h.host.stats().num_corrupt == 1


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_randomized_schedules_with_a_host_tier_keep_invariants(seed: int) -> None:
    """Random add / abort / preemption / GPU and host eviction (tight pools) over prompts that
    share prefixes: manager and host-pool integrity after every operation (every block free,
    cached or in use with the right counts; host bytes within budget); every restored position
    holds the request's token; outputs equal the uncached reference; all released at the end."""
    rng = random.Random(seed)
    h = HostHarness(
        num_blocks=rng.randrange(10, 24),
        num_host_slots=rng.randrange(1, 30),
        num_slots=rng.randrange(2, 6),
        budget=rng.randrange(8, 40),
        max_num_seqs=rng.randrange(2, 6),
        max_model_len=48,
        replay_tokens=rng.choice([1, 3, 4, 8]),
    )
    run_random_shared_prefix_schedule(h, rng)


# ---------------------------------------------------------------------------- tiny engine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 1000, (n - 1,), generator=g).tolist()


def _engine(model, **overrides) -> AsyncEngine:
    config = EngineConfig(
        model="tiny",
        max_num_seqs=2,
        kv_cache_tokens=1024,  # 8 blocks: two 700-token prompts do not fit together
        max_model_len=1024,
        swa_replay="exact",
        **overrides,
    )
    return AsyncEngine.from_model(model, config)


async def _run(engine: AsyncEngine, prompts, between=None) -> list:
    await engine.start()
    try:
        out = []
        for i, prompt in enumerate(prompts):
            if between is not None:
                between(i)
            tokens, cached = [], None
            async for delta in engine.generate(prompt, GREEDY, f"r{i}"):
                tokens.extend(delta.token_ids)
                cached = delta.num_cached_tokens
            out.append((tokens, cached))
        return out
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_exact_kv) -> list[int]:
    off = _engine(tiny_model_exact_kv, enable_prefix_caching=False)
    [(tokens, _)] = asyncio.run(_run(off, [_tokens(700, seed=11)]))
    return tokens


def test_tiny_engine_rehits_from_the_host_tier_with_the_cache_off_output(
    tiny_model_exact_kv, reference
) -> None:
    a, b, c = (_tokens(700, seed=s) for s in (11, 12, 13))
    engine = _engine(tiny_model_exact_kv, host_kv_cache_bytes=8 << 20)
    results = asyncio.run(_run(engine, [a, b, c, a]))
    (first, cached_first), *_, (again, cached_again) = results
    assert cached_first == 0 and first == reference
    assert cached_again == 640 and again == reference
    stats = engine.core.scheduler.prefix_reuse.stats()
    assert stats.hit_tokens_by_tier.get("host", 0) >= 384  # b and c evicted most of a's blocks
    assert stats.host.num_hits * 128 == stats.hit_tokens_by_tier["host"]
    assert stats.host.copied_bytes["gpu->host"] > 0
    assert_all_released(engine)


def test_tiny_engine_without_a_host_tier_recomputes_those_blocks(tiny_model_exact_kv) -> None:
    a, b, c = (_tokens(700, seed=s) for s in (11, 12, 13))
    engine = _engine(tiny_model_exact_kv, host_kv_cache_bytes=0)
    *_, (_, cached_again) = asyncio.run(_run(engine, [a, b, c, a]))
    assert cached_again < 640
    assert engine.core.scheduler.prefix_reuse.host is None


def test_tiny_engine_corrupt_host_slot_is_a_miss_never_wrong_output(
    tiny_model_exact_kv, reference
) -> None:
    a, b, c = (_tokens(700, seed=s) for s in (11, 12, 13))
    engine = _engine(tiny_model_exact_kv, host_kv_cache_bytes=8 << 20)
    reuse = engine.core.scheduler.prefix_reuse
    keys = chain_keys(chain_seed(reuse.config.fingerprint, combine_salts(None)), a, 128)
    victim = []

    def corrupt(i: int) -> None:
        if i == 3:  # before a's second run: flip a byte in the host slot of a block it needs
            index = max(len(engine.core.scheduler.kv_manager.prefix_cache.match(keys)), 2)
            [slot] = reuse.host.pool.read([keys[index]])
            slot[100] ^= 0x08
            victim.append(index)

    results = asyncio.run(_run(engine, [a, b, c, a], between=corrupt))
    again, cached_again = results[-1]
    assert cached_again == victim[0] * 128
    assert again == reference
    assert reuse.stats().host.num_corrupt == 1
    assert_all_released(engine)


# ---------------------------------------------------------------------------- with directories


def test_a_directory_hit_lands_in_the_host_tier_too(tiny_model_exact_kv, tmp_path) -> None:
    """Promotion: blocks read from the shared directory are copied into host slots as well as
    GPU blocks, so once the GPU evicts them the next hit needs no directory read."""
    a, b, c = (_tokens(700, seed=s) for s in (11, 12, 13))
    writer = _engine(tiny_model_exact_kv, kv_cache_shared_dir=str(tmp_path))
    asyncio.run(_run(writer, [a]))  # shutdown flushes the write-back
    reader = _engine(tiny_model_exact_kv, kv_cache_shared_dir=str(tmp_path))
    reuse = reader.core.scheduler.prefix_reuse
    results = asyncio.run(_run(reader, [a, b, c, a]))
    assert results[0][1] == 640 and results[-1][1] == 640
    assert results[0][0] == results[-1][0]
    by_tier = reuse.stats().hit_tokens_by_tier
    assert by_tier["shared"] == 640  # read once
    assert by_tier["host"] >= 384  # the second time from the host tier
    assert reuse.stats().host.copied_bytes["shared->host"] == 5 * reuse.host.pool.payload_len
    assert reuse.store.tiers.stores[0].stats().hits == 5


def test_a_host_hit_refreshes_the_directory_copies(tiny_model_exact_kv, tmp_path) -> None:
    """A hit in any tier extends the directory copies' deadlines (`cache.md` §2.4): a day
    later, a's blocks hit in the GPU and host tiers, and every one of its files is touched."""
    import os
    import time

    a, b, c = (_tokens(700, seed=s) for s in (11, 12, 13))
    engine = _engine(tiny_model_exact_kv, kv_cache_shared_dir=str(tmp_path))
    store = engine.core.scheduler.prefix_reuse.store.tiers.stores[0]
    reuse = engine.core.scheduler.prefix_reuse
    keys = chain_keys(chain_seed(reuse.config.fingerprint, combine_salts(None)), a, 128)
    deadlines: list[list[float]] = []

    def between(i: int) -> None:
        if i == 3:  # a's files are written; then it is a day later
            assert reuse.store.tiers.flush(30)
            deadlines.append([os.stat(store.path_of(k, d)).st_mtime for d, k in enumerate(keys)])
            store.clock = lambda: time.time() + 86400

    asyncio.run(_run(engine, [a, b, c, a], between=between))
    assert reuse.stats().hit_tokens_by_tier.get("host", 0) >= 384
    later = [os.stat(store.path_of(k, d)).st_mtime for d, k in enumerate(keys)]
    assert all(new >= old + 86000 for old, new in zip(deadlines[0], later, strict=True))


@pytest.mark.gpu
def test_cuda_saves_and_restores_on_streams_without_waiting() -> None:
    """On CUDA: a save issued on the side stream holds the bytes the pool had when it was
    issued, even though the compute stream overwrites those blocks right after (it waits for
    the gather only); a restore lands before later compute-stream work; pinned slots."""
    from benchmarks.host_tier import released_state
    from engine.model_runner import RunnerBlockPayloads

    state, layout = released_state(16, "cuda")
    payloads = RunnerBlockPayloads(state, layout)
    config = HostPoolConfig(8 * padded_len(layout.payload_len), layout.payload_len, True)
    pool = HostBlockPool(config)
    keys = [_key(i) for i in range(4)]
    expected = layout.gather(state, [0, 1, 2, 3]).cpu()
    pool.put(keys, lambda idx, slots: payloads.save(list(idx), slots), "gpu")
    for tensor in (*state.global_kv.values(), *state.index_keys.values()):
        tensor[:4].fill_(7)  # compute-stream writes into the saved blocks
    pool.wait()
    views = pool.read(keys)
    assert len(views) == 4 and all(torch.equal(v, e) for v, e in zip(views, expected, strict=True))
    handle = payloads.restore(views, [8, 9, 10, 11])
    pool.pin(keys, handle)
    restored = layout.gather(state, [8, 9, 10, 11]).cpu()  # compute stream: after the restore
    assert torch.equal(restored, expected)
    handle.wait()
    pool.poll()
    pool.check_integrity()
