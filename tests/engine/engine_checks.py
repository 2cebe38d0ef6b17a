"""Assertions shared by the engine's end-to-end tests."""

from __future__ import annotations

from engine.async_engine import AsyncEngine


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
