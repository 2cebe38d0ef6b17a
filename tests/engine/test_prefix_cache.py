"""Prefix cache: chain keys, the GPU-tier index and its LRU, the manager's hooks, and the
scheduler's admission matching (fake model, no torch). `check_integrity` after every operation.
"""

from __future__ import annotations

import hashlib
import random
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.kv_cache import CacheConfig, KVCacheManager, PrefixCache
from engine.kv_cache.hashing import (
    block_key,
    chain_keys,
    chain_seed,
    combine_salts,
    namespace_fingerprint,
)
from engine.kv_cache.reuse import PrefixReuse, PrefixReuseConfig
from engine.outputs import SchedulerOutput
from engine.request import FinishReason
from engine.scheduler import Scheduler
from tests.engine.test_scheduler import (
    BLOCK_TOKENS,
    FakeRunner,
    Harness,
    reference_output,
)

FINGERPRINT = namespace_fingerprint({"model": "golden"})

# ---------------------------------------------------------------------------- hashing


def test_golden_keys_follow_the_documented_formula() -> None:
    expected_fp = hashlib.sha256(b'{"model":"golden","schema":"deepinfer-kv/1"}').digest()
    assert expected_fp == FINGERPRINT
    salt = combine_salts("salt")
    assert salt == struct.pack("<I", 4) + b"salt"
    seed = chain_seed(FINGERPRINT, salt)
    assert (
        seed
        == hashlib.sha256(
            b"deepinfer-kv/1" + FINGERPRINT + struct.pack("<I", len(salt)) + salt
        ).digest()
    )
    keys = chain_keys(seed, list(range(256)), 128)
    first = hashlib.sha256(seed + struct.pack("<128I", *range(128))).digest()
    assert keys == [first, hashlib.sha256(first + struct.pack("<128I", *range(128, 256))).digest()]
    assert seed.hex().startswith("9a96a1d787848fe8")
    assert keys[1].hex().startswith("a1d3d95ed413c923")


def test_keys_are_the_same_in_processes_with_different_hash_seeds() -> None:
    code = (
        "from engine.kv_cache.hashing import *;"
        "s = chain_seed(namespace_fingerprint({'m': 'x', 'n': [1, 2]}), combine_salts('t'));"
        "print(chain_keys(s, list(range(300)), 128)[-1].hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1


def test_a_token_change_changes_its_block_and_every_later_key() -> None:
    seed = chain_seed(FINGERPRINT)
    tokens = list(range(1000, 1000 + 640))
    base = chain_keys(seed, tokens, 128)
    changed = list(tokens)
    changed[300] += 1  # block 2
    other = chain_keys(seed, changed, 128)
    assert len(base) == 5
    assert base[:2] == other[:2]
    assert all(a != b for a, b in zip(base[2:], other[2:], strict=True))


def test_salts_and_fingerprints_isolate_chains() -> None:
    tokens = list(range(512))
    plain = chain_keys(chain_seed(FINGERPRINT), tokens, 128)
    salted = chain_keys(chain_seed(FINGERPRINT, combine_salts("tenant-a")), tokens, 128)
    other_fp = namespace_fingerprint({"model": "golden", "numerics": "bounded-replay"})
    moved = chain_keys(chain_seed(other_fp), tokens, 128)
    assert not set(plain) & set(salted) and not set(plain) & set(moved)
    assert combine_salts("ab", "c") != combine_salts("a", "bc")
    assert combine_salts(None) == combine_salts("")


def test_fingerprint_is_canonical_and_partial_blocks_get_no_key() -> None:
    assert namespace_fingerprint({"a": 1, "b": [2]}) == namespace_fingerprint({"b": [2], "a": 1})
    assert chain_keys(chain_seed(FINGERPRINT), list(range(127)), 128) == []
    with pytest.raises(ValueError):
        block_key(b"short", [1])
    with pytest.raises(ValueError):
        block_key(chain_seed(FINGERPRINT), [-1])


# ---------------------------------------------------------------------------- PrefixCache


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_index_match_lock_unlock_and_lru_eviction_order() -> None:
    cache = PrefixCache()
    for i, block in enumerate((5, 6, 7)):
        assert cache.insert(key(i), block)
        cache.check_integrity()
    assert not cache.insert(key(0), 9)  # first writer wins
    assert not cache.insert(key(9), 5)  # a block holds one key
    assert cache.match([key(0), key(1), key(5), key(2)]) == [5, 6]
    assert cache.evict(3) == []  # all in use
    for block in (7, 6, 5):  # released deepest first
        assert cache.unlock(block)
        cache.check_integrity()
    assert not cache.unlock(42)  # not indexed: the caller frees it
    cache.lock(6)  # reused again: never evicted while held
    assert cache.evict(5) == [7, 5]
    cache.check_integrity()
    assert cache.match([key(0)]) == [] and cache.match([key(1)]) == [6]
    assert cache.stats().num_evicted == 2 and cache.stats().num_cached_blocks == 1


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random insert / lock / unlock / evict / match against a plain reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache()
        self.index: dict[bytes, int] = {}
        self.held: set[int] = set()  # blocks with a holder (indexed or not)
        self.lru: list[int] = []  # reference LRU, oldest first

    @rule(k=st.integers(0, 20), block=st.integers(0, 15))
    def insert(self, k: int, block: int) -> None:
        if block not in self.held:
            return  # only blocks in use are indexed
        expected = key(k) not in self.index and block not in self.index.values()
        assert self.cache.insert(key(k), block) == expected
        if expected:
            self.index[key(k)] = block

    @rule(block=st.integers(0, 15))
    def lock(self, block: int) -> None:
        if block in self.held:
            return
        self.held.add(block)
        self.cache.lock(block)
        if block in self.lru:
            self.lru.remove(block)

    @rule(block=st.integers(0, 15))
    def unlock(self, block: int) -> None:
        if block not in self.held:
            return
        self.held.discard(block)
        indexed = block in self.index.values()
        assert self.cache.unlock(block) == indexed
        if indexed:
            self.lru.append(block)

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        evicted = self.cache.evict(n)
        assert evicted == self.lru[:n]
        self.lru = self.lru[n:]
        self.index = {k: b for k, b in self.index.items() if b not in evicted}
        assert not set(evicted) & self.held

    @rule(ks=st.lists(st.integers(0, 20), max_size=6))
    def match(self, ks: list[int]) -> None:
        expected = []
        for k in ks:
            if key(k) not in self.index:
                break
            expected.append(self.index[key(k)])
        assert self.cache.match([key(k) for k in ks]) == expected

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()
        assert self.cache.num_evictable == len(self.lru)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------- manager hooks


def cached_manager(num_blocks: int = 8, num_slots: int = 4) -> KVCacheManager:
    kv = KVCacheManager(CacheConfig(num_blocks, num_slots, 4), PrefixCache())
    kv.check_integrity()
    return kv


def test_freed_cached_blocks_stay_indexed_and_are_evicted_only_when_needed() -> None:
    kv = cached_manager()
    cache = kv.prefix_cache
    assert kv.allocate("a", 12)
    table = kv.block_table("a")
    for i, block in enumerate(table[:2]):
        cache.insert(key(i), block)
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_blocks == 8 and kv.usage() == 0.0
    assert kv.stats().num_cached_blocks == 2
    assert kv.allocate("b", 4 * 6)  # 6 of 6 uncached free blocks: nothing evicted
    kv.check_integrity()
    assert cache.match([key(0), key(1)]) == list(table[:2])
    assert kv.allocate("c", 4)  # the pool is out of free blocks: the LRU's oldest goes
    kv.check_integrity()
    assert cache.match([key(0), key(1)]) == [table[0]]  # the leaf (block 1) went first


def test_allocate_takes_cached_blocks_first_and_shares_them() -> None:
    kv = cached_manager()
    cache = kv.prefix_cache
    kv.allocate("a", 8)
    first = kv.block_table("a")
    cache.insert(key(0), first[0])
    cache.insert(key(1), first[1])
    assert kv.allocate("b", 10, cached_blocks=first)
    kv.check_integrity()
    assert kv.block_table("b")[:2] == first and len(kv.block_table("b")) == 3
    assert not kv.allocate("b", 12, cached_blocks=first)  # only a new request takes cached blocks
    kv.free("a")
    kv.check_integrity()
    assert kv.stats().num_used_blocks == 3  # still held by b
    kv.free("b")
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_cached_blocks_being_reused_are_not_counted_as_evictable() -> None:
    kv = cached_manager(num_blocks=3)
    kv.allocate("a", 12)
    table = kv.block_table("a")
    for i, block in enumerate(table):
        kv.prefix_cache.insert(key(i), block)
    kv.free("a")
    # Reusing two cached blocks leaves one block for the rest: 4 blocks do not fit.
    assert not kv.can_allocate("b", 16, cached_blocks=table[:2])
    assert not kv.allocate("b", 16, cached_blocks=table[:2])
    kv.check_integrity()
    assert kv.allocate("b", 12, cached_blocks=table[:2])
    kv.check_integrity()


def test_randomized_manager_operations_with_a_cache_keep_integrity() -> None:
    rng = random.Random(1)
    kv = cached_manager(num_blocks=24, num_slots=5)
    cache = kv.prefix_cache
    next_key = 0
    for _ in range(1500):
        rid = f"r{rng.randrange(8)}"
        op = rng.random()
        if op < 0.25:
            kv.free(rid)
        elif op < 0.45 and kv.is_allocated(rid):
            for block in kv.block_table(rid):
                if rng.random() < 0.5:
                    next_key += 1
                    cache.insert(key(next_key), block)
        elif op < 0.65 and not kv.is_allocated(rid):
            candidates = [b for b in range(24) if cache.is_cached(b)]
            rng.shuffle(candidates)
            cached = candidates[: rng.randrange(0, 4)]
            tokens = len(cached) * 4 + rng.randrange(0, 12)
            expected = kv.can_allocate(rid, tokens, cached)
            assert kv.allocate(rid, tokens, cached) == expected
            if expected:
                assert kv.block_table(rid)[: len(cached)] == tuple(cached)
        else:
            tokens = rng.randrange(0, 40)
            expected = kv.can_allocate(rid, tokens)
            assert kv.allocate(rid, tokens) == expected
        kv.check_integrity()
    for rid in [f"r{i}" for i in range(8)]:
        kv.free(rid)
        kv.check_integrity()
    assert kv.num_free_blocks == 24 and kv.stats().num_used_blocks == 0


# ---------------------------------------------------------------------------- scheduler


class ReplayingFakeRunner(FakeRunner):
    """The fake model of test_scheduler, plus what a prefix hit promises the runner: positions
    below `num_reused_tokens` already hold the request's tokens in the shared blocks (they are
    read, never written), the replay restarts the slot at `window_floor`, and the history given
    is the tokens right before it."""

    def __init__(self, cache: CacheConfig, requests: dict) -> None:
        super().__init__(cache)
        self.requests = requests
        self.num_restores = 0

    def execute(self, out: SchedulerOutput):
        for chunk in out.chunks:
            restore = chunk.restore
            if restore is None:
                continue
            tokens = self.requests[chunk.request_id].all_token_ids
            for p in range(restore.num_reused_tokens):
                assert self.pool[self._address(chunk.block_table, p)] == tokens[p], "wrong block"
            if chunk.start_position == restore.window_floor:
                self.num_restores += 1
                self.slot_state[chunk.slot] = (chunk.request_id, chunk.start_position)
                floor = restore.window_floor
                assert list(restore.history_token_ids) == tokens[max(0, floor - 3) : floor]
        return super().execute(out)


class CachingHarness(Harness):
    def __init__(self, *, replay_tokens: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kv = KVCacheManager(self.cache, PrefixCache())
        config = PrefixReuseConfig(
            fingerprint=FINGERPRINT,
            replay_tokens=replay_tokens,
            num_history_tokens=3,
            block_tokens=BLOCK_TOKENS,
        )
        self.scheduler = Scheduler(self.config, self.kv, prefix_reuse=PrefixReuse(config, self.kv))
        self.runner = ReplayingFakeRunner(self.cache, self.requests)
        self.aborted: set[str] = set()

    def maybe_abort(self, rng: random.Random, probability: float = 0.03) -> None:
        """Abort a random request with this probability (remembered if it was unfinished)."""
        if self.requests and rng.random() < probability:
            rid = rng.choice(list(self.requests))
            if not self.requests[rid].is_finished:
                self.aborted.add(rid)
            self.abort(rid)

    def check_outputs_equal_the_reference(self) -> None:
        """Every request that was not aborted (nor failed) produced the fake model's uncached
        output; the others ended as aborted."""
        for rid, request in self.requests.items():
            if rid in self.aborted or request.error is not None:
                assert request.finish_reason is FinishReason.ABORT
                continue
            expected = reference_output(request.prompt_token_ids, 7, request.params.max_tokens)
            assert request.output_token_ids == expected, rid

    def check_all_finished(self) -> None:
        super().check_all_finished()
        assert self.kv.stats().num_used_blocks == 0  # every block free or cached, unreferenced


def test_second_request_with_the_same_prefix_hits_and_replays() -> None:
    h = CachingHarness(budget=64)
    prompt = list(range(1, 23))  # 5 full blocks of 4 + 2 tokens
    h.add("a", prompt, seed=3, max_tokens=4)
    h.run()
    h.add("b", prompt + [99, 98], seed=3, max_tokens=4)
    h.run()
    b_first = next(c for o in h.outputs for c in o.chunks if c.request_id == "b")
    # a computed 25 of its 26 tokens: 6 full blocks indexed, the 6th holding a's outputs; b's 6th
    # block holds 99, 98 instead, so b reuses 5 blocks and replays the last of them.
    assert b_first.restore is not None and b_first.restore.num_reused_tokens == 20
    assert b_first.start_position == 16  # one replayed block of 4
    assert h.requests["b"].num_cached_tokens == 20
    assert h.deltas["b"][-1].num_cached_tokens == 20 and h.deltas["a"][-1].num_cached_tokens == 0
    assert h.requests["b"].output_token_ids == reference_output(prompt + [99, 98], 3, 4)
    assert h.runner.num_restores == 1


def test_whole_prompt_in_cache_still_computes_the_replay_and_samples() -> None:
    h = CachingHarness(budget=64)
    prompt = list(range(1, 17))  # exactly 4 blocks
    h.add("a", prompt, seed=1, max_tokens=3)
    h.run()
    h.add("b", prompt, seed=1, max_tokens=3)
    h.run()
    b_first = next(c for o in h.outputs for c in o.chunks if c.request_id == "b")
    assert b_first.restore.num_reused_tokens == 16 and b_first.start_position == 12
    assert b_first.sampling is not None  # the replay's last row gives the logits
    assert h.requests["b"].output_token_ids == h.requests["a"].output_token_ids


def test_different_salts_share_nothing() -> None:
    h = CachingHarness(budget=64)
    prompt = list(range(1, 30))
    h.add("a", prompt, max_tokens=2)
    h.requests["a"].cache_salt = "tenant-a"  # before its first admission
    h.run()
    for rid, salt in (("b", "tenant-b"), ("c", None), ("d", "tenant-a")):
        request = h.add(rid, prompt, max_tokens=2)
        request.cache_salt = salt
        h.run()
    assert [h.requests[r].num_cached_tokens for r in "bcd"] == [0, 0, 28]


def test_preempted_request_rematches_its_own_blocks() -> None:
    h = CachingHarness(num_blocks=9, budget=64, max_model_len=64)
    for rid in ("a", "b", "c"):
        h.add(rid, 10, max_tokens=14)
    h.run()
    assert h.scheduler.num_preemptions > 0
    assert h.scheduler.prefix_reuse.stats().num_hit_tokens > 0
    for rid, request in h.requests.items():
        assert request.output_token_ids == reference_output(
            request.prompt_token_ids, request.seed, 14
        ), rid


def run_random_shared_prefix_schedule(h: CachingHarness, rng: random.Random) -> None:
    """120 steps of random adds (prompts cut from 3 shared stems) and aborts, then run to the
    end; the harness checks integrity after every operation, and the outputs here."""
    stems = [[rng.randrange(1, 50) for _ in range(30)] for _ in range(3)]
    for _ in range(120):
        if len(h.requests) < 30 and rng.random() < 0.35:
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(1, 30)] + [rng.randrange(1, 50)] * rng.randrange(0, 3)
            h.add(f"r{len(h.requests)}", prompt, max_tokens=rng.randrange(1, 12), seed=7)
        h.maybe_abort(rng)
        h.step()
    h.run()
    h.check_outputs_equal_the_reference()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_randomized_schedules_with_sharing_keep_invariants(seed: int) -> None:
    """Random add / abort / preemption (tight pools) / eviction over prompts that share prefixes;
    integrity after every operation; outputs equal the fake model's uncached reference."""
    rng = random.Random(seed)
    h = CachingHarness(
        num_blocks=rng.randrange(10, 24),
        num_slots=rng.randrange(2, 6),
        budget=rng.randrange(8, 40),
        max_num_seqs=rng.randrange(2, 6),
        max_model_len=48,
        replay_tokens=rng.choice([1, 3, 4, 8]),
    )
    run_random_shared_prefix_schedule(h, rng)
