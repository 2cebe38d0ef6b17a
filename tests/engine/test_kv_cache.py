"""KVCacheManager: allocation contract, integrity checks, randomized operation sequences."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache import CacheConfig, KVCacheManager


def make_manager(num_blocks: int = 8, num_slots: int = 3, block_tokens: int = 4) -> KVCacheManager:
    kv = KVCacheManager(CacheConfig(num_blocks, num_slots, block_tokens))
    kv.check_integrity()
    return kv


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0, "num_slots": 1},
        {"num_blocks": 1, "num_slots": 0},
        {"num_blocks": 1, "num_slots": 1, "block_tokens": 0},
        {"num_blocks": 2.5, "num_slots": 1},
        {"num_blocks": True, "num_slots": 1},
    ],
)
def test_config_rejects_bad_sizes(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="CacheConfig"):
        CacheConfig(**kwargs)


def test_config_defaults_to_128_token_blocks() -> None:
    assert CacheConfig(num_blocks=1, num_slots=1).block_tokens == 128


def test_num_blocks_needed_is_ceil_division() -> None:
    kv = make_manager(block_tokens=4)
    assert [kv.num_blocks_needed(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    with pytest.raises(ValueError):
        kv.num_blocks_needed(-1)


def test_allocate_grows_table_and_keeps_earlier_entries() -> None:
    kv = make_manager()
    assert kv.allocate("a", 5)
    kv.check_integrity()
    slot, table = kv.slot("a"), kv.block_table("a")
    assert len(table) == 2 and kv.is_allocated("a")
    assert kv.allocate("a", 3)  # smaller: no-op, never shrinks
    kv.check_integrity()
    assert kv.block_table("a") == table
    assert kv.allocate("a", 9)
    kv.check_integrity()
    assert kv.block_table("a")[:2] == table and len(kv.block_table("a")) == 3
    assert kv.slot("a") == slot
    assert kv.num_free_blocks == 5 and kv.num_free_slots == 2
    assert kv.usage() == pytest.approx(3 / 8)


def test_allocate_zero_tokens_takes_only_a_slot() -> None:
    kv = make_manager()
    assert kv.allocate("a", 0)
    kv.check_integrity()
    assert kv.block_table("a") == () and kv.num_free_slots == 2 and kv.num_free_blocks == 8


def test_allocate_is_all_or_nothing_when_blocks_run_out() -> None:
    kv = make_manager(num_blocks=4)
    assert kv.allocate("a", 12)  # 3 blocks
    before = (kv.stats(), kv.block_table("a"))
    assert not kv.can_allocate("a", 20)
    assert not kv.allocate("a", 20)  # needs 2 more, 1 free
    kv.check_integrity()
    assert not kv.can_allocate("b", 5)
    assert not kv.allocate("b", 5)  # new request: must not even take a slot
    kv.check_integrity()
    assert (kv.stats(), kv.block_table("a")) == before
    assert not kv.is_allocated("b")


def test_allocate_fails_without_a_free_slot() -> None:
    kv = make_manager(num_slots=2)
    assert kv.allocate("a", 1) and kv.allocate("b", 1)
    assert not kv.can_allocate("c", 1)
    assert not kv.allocate("c", 1)
    kv.check_integrity()
    assert kv.allocate("a", 8)  # existing requests keep growing without a new slot
    kv.check_integrity()


def test_free_returns_everything_and_is_idempotent() -> None:
    kv = make_manager()
    assert kv.allocate("a", 10) and kv.allocate("b", 3)
    kv.free("a")
    kv.check_integrity()
    assert not kv.is_allocated("a") and kv.block_table("a") == ()
    with pytest.raises(KeyError, match="holds no slot"):
        kv.slot("a")
    kv.free("a")  # freeing twice: no-op
    kv.free("never-seen")  # unknown id: no-op
    kv.check_integrity()
    assert kv.num_free_blocks == 7 and kv.num_free_slots == 2
    kv.free("b")
    kv.check_integrity()
    assert kv.num_free_blocks == 8 and kv.num_free_slots == 3 and kv.usage() == 0.0


def test_stats_snapshot() -> None:
    kv = make_manager()
    kv.allocate("a", 6)
    stats = kv.stats()
    assert (stats.num_blocks, stats.num_used_blocks) == (8, 2)
    assert (stats.num_slots, stats.num_used_slots, stats.num_requests) == (3, 1, 1)


# NOTE: the corruption tests below reach into private fields on purpose: the only way to prove
# that check_integrity() notices a broken invariant is to break one.


def test_integrity_detects_a_block_both_free_and_owned() -> None:
    kv = make_manager()
    kv.allocate("a", 4)
    kv._free_blocks.append(kv.block_table("a")[0])
    with pytest.raises(AssertionError, match="both free and owned|twice in the free list"):
        kv.check_integrity()


def test_integrity_detects_a_block_owned_twice() -> None:
    kv = make_manager()
    kv.allocate("a", 4)
    kv.allocate("b", 4)
    kv._block_tables["b"].append(kv.block_table("a")[0])
    with pytest.raises(AssertionError, match="reference count 1 but is listed by 2"):
        kv.check_integrity()


def test_integrity_detects_a_leaked_block() -> None:
    kv = make_manager()
    kv._free_blocks.popleft()
    with pytest.raises(AssertionError, match="neither free, cached nor owned"):
        kv.check_integrity()


def test_integrity_detects_a_double_assigned_slot() -> None:
    kv = make_manager()
    kv.allocate("a", 1)
    kv.allocate("b", 1)
    kv._slots["b"] = kv.slot("a")
    with pytest.raises(AssertionError, match="slot is assigned to two requests"):
        kv.check_integrity()


def test_randomized_operations_keep_integrity() -> None:
    rng = random.Random(0)
    kv = make_manager(num_blocks=32, num_slots=6, block_tokens=4)
    held: dict[str, int] = {}  # request id -> tokens it holds blocks for
    for step in range(2000):
        request_id = f"r{rng.randrange(10)}"
        if rng.random() < 0.3:
            kv.free(request_id)
            held.pop(request_id, None)
        else:
            num_tokens = rng.randrange(0, 40)
            expected = kv.can_allocate(request_id, num_tokens)
            before = kv.stats()
            ok = kv.allocate(request_id, num_tokens)
            assert ok == expected, step
            if ok:
                held[request_id] = max(held.get(request_id, 0), num_tokens)
            else:
                assert kv.stats() == before
        kv.check_integrity()
        for rid, num_tokens in held.items():
            assert len(kv.block_table(rid)) == kv.num_blocks_needed(num_tokens)
        assert kv.num_free_blocks == 32 - sum(len(kv.block_table(r)) for r in held)
    for rid in list(held):
        kv.free(rid)
        kv.check_integrity()
    assert kv.num_free_blocks == 32 and kv.num_free_slots == 6
