"""The canonical block payload layout (`cache.md` §1.3): the released config's sections at the
documented offsets, gather/scatter round trips, and one layout in every tier (a directory
file's payload is exactly the host slot's bytes)."""

from __future__ import annotations

import asyncio
import os

import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.kv_cache.hashing import chain_keys, chain_seed, combine_salts
from engine.kv_cache.store.format import parse
from engine.models.deepseek_v41.block_layout import BlockLayout
from engine.models.deepseek_v41.kv_formats import make_codec
from engine.models.deepseek_v41.state import ModelState
from engine.sampling_params import SamplingParams


def _state(num_blocks: int, main_width: int, index_width: int, dtype=torch.uint8) -> ModelState:
    """Pools of the released shapes: sources 2, 8, 14 at ratio 2 (64 rows), 20 at ratio 1."""
    rows = {2: 64, 8: 64, 14: 64, 20: 128}
    return ModelState(
        swa=[],
        global_kv={s: torch.zeros(num_blocks, n, main_width, dtype=dtype) for s, n in rows.items()},
        index_keys={
            s: torch.zeros(num_blocks, n, index_width, dtype=dtype) for s, n in rows.items()
        },
        pending={},
        tokens=torch.zeros(1, 16, dtype=torch.long),
    )


def test_released_config_sections_sit_at_the_documented_offsets() -> None:
    main, index = make_codec("global_fp4", 512), make_codec("index_fp4", 128)
    layout = BlockLayout.of(_state(1, main.row_width, index.row_width), main, index)
    offsets = [(s.source, s.kind, s.offset, s.size) for s in layout.sections]
    assert offsets[:4] == [
        (2, "main", 0, 16384),
        (2, "main", 16384, 2048),
        (2, "index", 18432, 4096),
        (2, "index", 22528, 256),
    ]
    assert [o for _, _, o, _ in offsets[4::4]] == [22784, 45568, 68352]
    assert offsets[12:] == [
        (20, "main", 68352, 32768),
        (20, "main", 101120, 4096),
        (20, "index", 105216, 8192),
        (20, "index", 113408, 512),
    ]
    assert layout.payload_len == 113920


def test_gather_scatter_round_trip_and_the_sections_split_rows() -> None:
    main, index = make_codec("global_fp4", 32), make_codec("index_fp4", 32)
    state = _state(3, main.row_width, index.row_width)
    g = torch.Generator().manual_seed(0)
    for pool in (*state.global_kv.values(), *state.index_keys.values()):
        pool.copy_(torch.randint(0, 256, pool.shape, generator=g, dtype=torch.uint8))
    layout = BlockLayout.of(state, main, index)
    payload = layout.gather(state, [2])[0]
    data = main.row_sections[0]
    # the first section is source 2's main data bytes of every row, row after row
    assert torch.equal(payload[: 64 * data], state.global_kv[2][2, :, :data].reshape(-1))
    other = _state(3, main.row_width, index.row_width)
    layout.scatter(other, [0], layout.gather(state, [2]))
    for src in state.global_kv:
        assert torch.equal(other.global_kv[src][0], state.global_kv[src][2])
        assert torch.equal(other.index_keys[src][0], state.index_keys[src][2])
        assert not other.global_kv[src][1:].any()
    assert layout.to_bytes(state, 1) == bytes(layout.gather(state, [1])[0].numpy())


def test_exact_storage_has_one_section_per_pool_row() -> None:
    main = make_codec("global_fp4", 32, quantize=False)
    index = make_codec("index_fp4", 32, quantize=False)
    state = _state(2, 32, 32, dtype=torch.float32)
    state.global_kv[20][1].normal_()
    layout = BlockLayout.of(state, main, index)
    assert len(layout.sections) == 8 and layout.payload_len == 64 * 128 * 6 + 128 * 128 * 2
    other = _state(2, 32, 32, dtype=torch.float32)
    layout.from_bytes(other, 0, layout.to_bytes(state, 1))
    assert torch.equal(other.global_kv[20][0], state.global_kv[20][1])


def test_a_directory_file_holds_exactly_the_host_slot_bytes(tiny_model, tmp_path) -> None:
    """One layout in every tier: the payload written for a block is its host slot's bytes."""
    config = EngineConfig(
        model="tiny", max_num_seqs=2, kv_cache_tokens=4096, kv_cache_dir=str(tmp_path)
    )
    engine = AsyncEngine.from_model(tiny_model, config)
    prompt = [0] + [3 + (7 * i) % 900 for i in range(299)]  # 2 full blocks

    async def run() -> None:
        await engine.start()
        try:
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=2), "r"):
                pass
        finally:
            await engine.shutdown()  # flushes the write-back

    asyncio.run(run())
    reuse = engine.core.scheduler.prefix_reuse
    keys = chain_keys(chain_seed(reuse.config.fingerprint, combine_salts(None)), prompt, 128)
    files = {
        name: os.path.join(root, name)
        for root, _, names in os.walk(tmp_path)
        for name in names
        if name.endswith(".kvb")
    }
    assert len(files) == 2
    pool = reuse.host.pool
    for path in files.values():
        with open(path, "rb") as f:
            identity, payload = parse(f.read(), pool.payload_len)
        assert identity.key in keys
        assert payload == pool.payload(identity.key)
