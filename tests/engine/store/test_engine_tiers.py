"""The directory tiers under the engine's GPU tier, on the `tiny` model: write-back of computed
prompt blocks, loads on a GPU-tier miss (another engine's blocks through a shared directory),
and faults that must never change the output (`cache.md` §2.4–§2.6, §6.2, §6.5)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.engine_checks import assert_all_released
from tests.engine.store.faults import EIO, ENOSPC, FaultyOps

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 1000, (n - 1,), generator=g).tolist()


def _engine(model, shared: str | None, **overrides) -> AsyncEngine:
    config = EngineConfig(
        model="tiny",
        max_num_seqs=4,
        kv_cache_tokens=8192,
        swa_replay="exact",
        kv_cache_shared_dir=shared,
        **overrides,
    )
    return AsyncEngine.from_model(model, config)


def _tiers(engine: AsyncEngine):
    return engine.core.scheduler.prefix_reuse.store.tiers


async def _run(engine: AsyncEngine, prompts: list[list[int]], flush: bool = True) -> list:
    await engine.start()
    try:
        out = []
        for i, prompt in enumerate(prompts):
            tokens, cached = [], None
            async for delta in engine.generate(prompt, GREEDY, f"r{i}", traffic_class="agent"):
                tokens.extend(delta.token_ids)
                cached = delta.num_cached_tokens
            out.append((tokens, cached))
        if flush:
            assert await asyncio.to_thread(_tiers(engine).flush, 30)
        return out
    finally:
        await engine.shutdown()


def _kvb_files(root) -> list[str]:
    return [n for _, _, files in os.walk(root) for n in files if n.endswith(".kvb")]


def test_blocks_written_by_one_engine_hit_in_another(tiny_model_exact_kv, tmp_path) -> None:
    prompt = _tokens(700, seed=1)  # 5 full blocks
    a = _engine(tiny_model_exact_kv, str(tmp_path))
    [(out_a, cached_a)] = asyncio.run(_run(a, [prompt]))
    assert cached_a == 0 and len(_kvb_files(tmp_path)) == 5
    b = _engine(tiny_model_exact_kv, str(tmp_path))
    [(out_b, cached_b)] = asyncio.run(_run(b, [prompt]))
    assert cached_b == 640 and out_b == out_a
    reuse = b.core.scheduler.prefix_reuse
    assert reuse.stats().hit_tokens_by_tier == {"shared": 640}
    assert _tiers(b).stores[0].stats().hits == 5
    assert_all_released(a)
    assert_all_released(b)


def test_a_cache_off_engine_gives_the_same_output(tiny_model_exact_kv, tmp_path) -> None:
    """The test above can fail: outputs differ when the loaded blocks are not what the model
    computed (here: zeroed payloads on load) — and equal a cache-off engine when they are."""
    prompt = _tokens(700, seed=2)
    off = AsyncEngine.from_model(
        tiny_model_exact_kv,
        EngineConfig(
            model="tiny", max_num_seqs=4, kv_cache_tokens=8192, enable_prefix_caching=False
        ),
    )
    [(reference, _)] = asyncio.run(_run_plain(off, prompt))
    asyncio.run(_run(_engine(tiny_model_exact_kv, str(tmp_path)), [prompt]))
    b = _engine(tiny_model_exact_kv, str(tmp_path))
    [(out_b, cached)] = asyncio.run(_run(b, [prompt]))
    assert cached == 640 and out_b == reference
    broken = _engine(tiny_model_exact_kv, str(tmp_path))
    payloads = broken.core.scheduler.prefix_reuse.store.payloads
    real_load = payloads.load
    payloads.load = lambda blocks, data: real_load(blocks, [bytes(len(d)) for d in data])
    [(out_broken, cached)] = asyncio.run(_run(broken, [prompt]))
    assert cached == 640 and out_broken != reference


async def _run_plain(engine: AsyncEngine, prompt: list[int]) -> list:
    await engine.start()
    try:
        tokens = []
        async for delta in engine.generate(prompt, GREEDY, "plain"):
            tokens.extend(delta.token_ids)
        return [(tokens, None)]
    finally:
        await engine.shutdown()


@pytest.mark.parametrize(
    "fault",
    ["flipped-byte", "truncated", "eio", "deleted", "enospc", "crash-before-link"],
)
def test_faults_are_misses_or_skipped_writes_never_wrong_output(
    tiny_model_exact_kv, tmp_path, fault
) -> None:
    prompt = _tokens(700, seed=3)
    a = _engine(tiny_model_exact_kv, str(tmp_path))
    ops = FaultyOps()
    store_a = _tiers(a).stores[0]
    store_a.ops = ops
    if fault == "enospc":
        ops.fail["write_new"] = ENOSPC
    if fault == "crash-before-link":
        ops.link = _raise_eio_on_blocks(ops.link)
    [(out_a, _)] = asyncio.run(_run(a, [prompt]))
    errors = store_a.stats().write_errors
    if fault in ("enospc", "crash-before-link"):
        assert errors == {"enospc": 1} if fault == "enospc" else errors == {"eio": 1}
        assert _kvb_files(tmp_path) == []  # the chain stopped at its first failed write
        assert sum(_tiers(a).writes_dropped()["shared"].values()) == 5
    b = _engine(tiny_model_exact_kv, str(tmp_path))
    store_b = _tiers(b).stores[0]
    store_b.ops = FaultyOps()
    victim = "-2.kvb"  # the third block: blocks 0 and 1 still hit
    if fault == "flipped-byte":
        store_b.ops.read_hook = lambda p, d: _flip(d, 5000) if p.endswith(victim) else d
    if fault == "truncated":
        store_b.ops.read_hook = lambda p, d: d[:-1] if p.endswith(victim) else d
    if fault == "eio":
        store_b.ops.read = _fail_on(store_b.ops.read, victim, EIO)
    if fault == "deleted":
        store_b.ops.before_read = lambda p: os.unlink(p) if p.endswith(victim) else None
    [(out_b, cached_b)] = asyncio.run(_run(b, [prompt]))
    assert out_b == out_a
    expected = {"flipped-byte": 256, "truncated": 256, "eio": 256, "deleted": 256}
    assert cached_b == expected.get(fault, 0)
    reasons = store_b.stats().corrupt
    if fault in ("flipped-byte", "truncated", "eio"):
        assert reasons == {"flipped-byte": {"payload_crc": 1}, "truncated": {"size": 1}}.get(
            fault, {"io_error": 1}
        )
    assert_all_released(b)


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x10]) + data[offset + 1 :]


def _fail_on(read, suffix: str, code: int):
    def wrapped(path: str):
        if path.endswith(suffix):
            raise OSError(code, os.strerror(code), path)
        return read(path)

    return wrapped


def _raise_eio_on_blocks(link):
    """A crash between temp write and link, as the writer thread sees it: the link fails."""

    def wrapped(src: str, dst: str) -> None:
        if dst.endswith(".kvb"):
            raise OSError(EIO, "crashed", dst)
        link(src, dst)

    return wrapped


def test_a_slow_tier_never_stalls_a_request(tiny_model_exact_kv, tmp_path) -> None:
    """A read that hangs past `kv_load_timeout_s`: the request proceeds with the prefix loaded
    so far (blocks 0 and 1) and gives the same output; the engine step never waited."""
    prompt = _tokens(700, seed=4)
    [(out_a, _)] = asyncio.run(_run(_engine(tiny_model_exact_kv, str(tmp_path)), [prompt]))
    b = _engine(tiny_model_exact_kv, str(tmp_path), kv_load_timeout_s=0.3)
    store_b = _tiers(b).stores[0]
    store_b.ops = FaultyOps()
    store_b.ops.before_read = lambda p: time.sleep(2) if p.endswith("-2.kvb") else None
    started = time.monotonic()
    [(out_b, cached_b)] = asyncio.run(_run(b, [prompt], flush=False))
    assert out_b == out_a and cached_b == 256
    assert time.monotonic() - started < 10
    assert_all_released(b)


def test_abort_while_waiting_for_kv_releases_everything(tiny_model_exact_kv, tmp_path) -> None:
    prompt = _tokens(700, seed=5)
    asyncio.run(_run(_engine(tiny_model_exact_kv, str(tmp_path)), [prompt]))
    b = _engine(tiny_model_exact_kv, str(tmp_path), kv_load_timeout_s=30)
    store_b = _tiers(b).stores[0]
    store_b.ops = FaultyOps()
    store_b.ops.before_read = lambda p: time.sleep(1) if p.endswith("-1.kvb") else None

    async def scenario() -> list:
        await b.start()
        try:
            task = asyncio.create_task(_first_delta(b, prompt))
            await asyncio.sleep(0.3)  # the request now waits for its blocks
            reuse = b.core.scheduler.prefix_reuse
            assert reuse.num_waiting_for_kv == 1 and b.core.scheduler.num_running == 0
            task.cancel()  # the client leaves: the engine aborts the request
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            return [reuse.num_waiting_for_kv]
        finally:
            await b.shutdown()

    assert asyncio.run(scenario()) == [0]
    assert_all_released(b)


async def _first_delta(engine: AsyncEngine, prompt: list[int]):
    async for delta in engine.generate(prompt, GREEDY, "waiting"):
        return delta


class _Later:
    """A store clock `offset_s` ahead of the real one."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def __call__(self) -> float:
        return time.time() + self.offset_s


def test_a_gpu_hit_refreshes_the_directory_copies(tiny_model_exact_kv, tmp_path) -> None:
    """Agent blocks live 3 days from their last use in any tier: a GPU-tier hit two days
    later moves their deadline to 5 days; a reader 6 days later misses them (an expired block
    is never served), answers the same and replaces them."""
    prompt = _tokens(700, seed=6)
    a = _engine(tiny_model_exact_kv, str(tmp_path))
    store_a = _tiers(a).stores[0]
    day = 86400.0

    async def two_turns() -> list:
        await a.start()
        try:
            out = []
            for offset in (0.0, 2 * day):
                store_a.clock = _Later(offset)
                tokens, cached = [], 0
                async for delta in a.generate(prompt, GREEDY, f"t{offset}", traffic_class="agent"):
                    tokens.extend(delta.token_ids)
                    cached = delta.num_cached_tokens
                out.append((tokens, cached))
                assert await asyncio.to_thread(_tiers(a).flush, 30)
            return out
        finally:
            await a.shutdown()

    (out_1, cached_1), (out_2, cached_2) = asyncio.run(two_turns())
    assert (cached_1, cached_2) == (0, 640) and out_1 == out_2
    deadlines = [os.stat(store_a.path_of(k, i)).st_mtime for i, k in enumerate(_keys(a, prompt))]
    assert all(abs(d - (time.time() + 5 * day)) < 600 for d in deadlines)
    b = _engine(tiny_model_exact_kv, str(tmp_path))
    _tiers(b).stores[0].clock = _Later(6 * day)
    [(out_b, cached_b)] = asyncio.run(_run(b, [prompt]))
    assert cached_b == 0 and out_b == out_1
    assert _tiers(b).stores[0].stats().expired >= 1  # a read, or the background GC, saw it
    # B recomputed the blocks and replaced the expired files (deadline 6 + 3 days).
    deadlines = [os.stat(store_a.path_of(k, i)).st_mtime for i, k in enumerate(_keys(a, prompt))]
    assert all(abs(d - (time.time() + 9 * day)) < 600 for d in deadlines)


def _keys(engine: AsyncEngine, prompt: list[int]) -> list[bytes]:
    from engine.kv_cache.hashing import chain_keys, chain_seed

    reuse = engine.core.scheduler.prefix_reuse
    return chain_keys(chain_seed(reuse.config.fingerprint, b"\0\0\0\0"), prompt, 128)


def test_blocks_found_in_the_shared_tier_are_promoted_to_the_local_one(
    tiny_model_exact_kv, tmp_path
) -> None:
    prompt = _tokens(700, seed=7)
    shared, local = str(tmp_path / "shared"), str(tmp_path / "local")
    [(out_a, _)] = asyncio.run(_run(_engine(tiny_model_exact_kv, shared), [prompt]))
    b = _engine(tiny_model_exact_kv, shared, kv_cache_dir=local)
    [(out_b, cached_b)] = asyncio.run(_run(b, [prompt]))
    assert cached_b == 640 and out_b == out_a
    assert b.core.scheduler.prefix_reuse.stats().hit_tokens_by_tier == {"shared": 640}
    assert len(_kvb_files(local)) == 5  # promoted while B served the request
    c = _engine(tiny_model_exact_kv, None, kv_cache_dir=local)
    [(out_c, cached_c)] = asyncio.run(_run(c, [prompt]))
    assert cached_c == 640 and out_c == out_a
    assert c.core.scheduler.prefix_reuse.stats().hit_tokens_by_tier == {"local": 640}
