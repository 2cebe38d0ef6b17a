"""Assertions shared by the engine's end-to-end tests."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams


def assert_all_released(engine: AsyncEngine) -> None:
    """Nothing is left: scheduler invariants hold, no request is unfinished, every KV block and
    state slot is free, and the runner holds no grammar matcher."""
    scheduler = engine.core.scheduler
    scheduler.check_integrity()
    assert not scheduler.has_unfinished_requests()
    kv = scheduler.kv_manager
    assert kv.num_free_blocks == kv.config.num_blocks
    assert kv.num_free_slots == kv.config.num_slots
    grammar = engine.core.runner.grammar
    assert grammar is None or grammar.num_matchers == 0


def abort_mid_stream(engine: AsyncEngine, params: SamplingParams) -> list[int]:
    """Start the engine, read at least 3 tokens from each of 4 decoding streams, cancel a long
    prefill while it is queued or running, close every stream and shut down; returns the number
    of tokens each decoding stream delivered before it was closed."""

    async def scenario() -> list[int]:
        await engine.start()
        streams = [engine.generate([0, 5 + i, 6], params, f"d{i}") for i in range(4)]
        prefill = engine.generate([0, *range(3, 600)], params, "prefill")
        counts = []
        for stream in streams:
            count = 0
            async for delta in stream:
                count += len(delta.token_ids)
                if count >= 3:
                    break
            counts.append(count)
        task = asyncio.create_task(prefill.__anext__())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for stream in streams:
            await stream.aclose()
        await prefill.aclose()
        await engine.shutdown()
        return counts

    return asyncio.run(scenario())
