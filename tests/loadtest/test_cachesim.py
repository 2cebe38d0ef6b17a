"""The block-level simulator: hand-computed hit rates on small traces, TTL by class, LRU above
the watermark, and the in-memory model against the real `DirBlockStore`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.kv_cache.store.ttl import TTLPolicy
from loadtest.cachesim import DirTier, MemoryTier, SimConfig, main, simulate
from loadtest.traces import (
    AgentTraceConfig,
    ChatTraceConfig,
    Segment,
    TraceSession,
    Turn,
    agent_trace,
    chat_trace,
)

DAY = 86400.0
POLICY = TTLPolicy.parse("agent=3d,chat=7d")


def _session(index: int, kind: str, system: int, turns: list[Turn], start: float = 0.0):
    segment = Segment(f"test-system-{system}", 256)
    return TraceSession(index, kind, start, segment, kind == "agent", "high", tuple(turns))


def _turn(index: int, think_s: float = 0.0, tokens: int = 128, output: int = 128) -> Turn:
    return Turn(think_s, (Segment(f"test-add-{index}", tokens),), output, output)


def test_agent_turn_hits_the_previous_prompt_and_output_blocks() -> None:
    # Turn 1: 256 system + 128 task = 3 blocks, all computed; its 128-token output is written.
    # Turn 2: + 128 tool result = 5 blocks, of which 3 + 1 are cached.
    session = _session(0, "agent", 0, [_turn(0), _turn(1, think_s=5.0)])
    result = simulate([session], MemoryTier(POLICY), SimConfig())
    assert result.requests == [(0, 0, "agent", 384, 0), (0, 1, "agent", 640, 512)]
    assert result.hit_rate() == pytest.approx(512 / 1024)


def test_chat_history_reuses_the_prompt_but_not_the_output_and_other_users_share_the_system() -> (
    None
):
    chat = [_turn(0), _turn(1, think_s=5.0)]
    first = _session(0, "chat", 0, chat)
    second = _session(1, "chat", 0, [_turn(9)], start=60.0)
    result = simulate([first, second], MemoryTier(POLICY), SimConfig())
    # Chat writes no output blocks: turn 2 (384 + 128 answer + 128) reuses the 3 prompt blocks;
    # the other user reuses the 2 system blocks.
    assert result.requests == [
        (0, 0, "chat", 384, 0),
        (0, 1, "chat", 640, 384),
        (1, 0, "chat", 384, 256),
    ]


def test_ttl_is_per_class_and_a_revisit_within_it_hits() -> None:
    def revisit_after(days: float, kind: str) -> int:
        session = _session(0, kind, 0, [_turn(0), _turn(1, think_s=days * DAY)])
        return simulate([session], MemoryTier(POLICY), SimConfig()).requests[1][4]

    assert revisit_after(2.9, "agent") == 512
    assert revisit_after(3.1, "agent") == 0  # expired: agent TTL 3 days
    assert revisit_after(3.1, "chat") == 384  # chat TTL 7 days
    assert revisit_after(7.1, "chat") == 0
    shorter = TTLPolicy.parse("agent=3d,chat=3d")
    session = _session(0, "chat", 0, [_turn(0), _turn(1, think_s=3.1 * DAY)])
    assert simulate([session], MemoryTier(shorter), SimConfig()).requests[1][4] == 0


def test_above_the_high_watermark_gc_evicts_earliest_deadline_leaves_first() -> None:
    tier = MemoryTier(POLICY, capacity_blocks=10)
    # Session A (3 blocks) then B, C: 5 distinct system prompts × 3 blocks = 15 > 9: the GC
    # deletes the earliest deadlines first, down to 8 blocks. (The sessions are 15 minutes
    # apart: deadlines within one touch granule, 10 minutes, are ties, and go deeper first.)
    sessions = [_session(i, "chat", i, [_turn(100 + i)], start=i * 900.0) for i in range(5)]
    simulate(sessions, tier, SimConfig())
    assert tier.counts()["blocks"] <= 9 and tier.evicted >= 6
    again = [_session(10 + i, "chat", i, [_turn(100 + i)], start=5000 + i) for i in (0, 4)]
    result = simulate(again, tier, SimConfig())
    assert result.requests[0][4] == 0  # the oldest session's blocks were evicted
    assert result.requests[1][4] == 384  # the newest survived


def test_the_memory_model_makes_the_same_decisions_as_the_real_directory_store(tmp_path) -> None:
    agents = AgentTraceConfig(
        seed=5, num_sessions=6, session_rate=1 / 3600, system_tokens_min=200,
        system_tokens_max=500, num_types=2, turns_mean=4, task_tokens=50, output_median=60,
        output_min=20, output_max=200, tool_result_median=80, tool_result_max=400,
    )  # fmt: skip
    chats = ChatTraceConfig(
        seed=5, num_sessions=12, session_rate=1 / 1800, system_tokens_min=200,
        system_tokens_max=500, num_variants=2, question_median=40, output_median=100,
        revisit_probability=0.5, revisit_median_s=3 * DAY,
    )  # fmt: skip
    sessions = agent_trace(agents) + chat_trace(chats)
    config = SimConfig(gc_interval_s=3 * 3600.0, end_s=12 * DAY)
    for capacity in (0, 40):
        memory = simulate(sessions, MemoryTier(POLICY, capacity), config)
        real = simulate(sessions, DirTier(str(tmp_path / f"c{capacity}"), POLICY, capacity), config)
        assert memory.requests == real.requests
        assert 0 < memory.hit_rate() < 1
        if not capacity:
            assert memory.tier["expired"] > 0  # revisits after the TTL miss in both
        if capacity:
            assert memory.tier["evicted"] == real.tier["evicted"] > 0


def test_the_cli_prints_the_ttl_table(capsys) -> None:
    lines: list[str] = []
    argv = ["--days", "2", "--warmup-days", "0.5", "--agent-sessions-per-day", "5",
            "--chat-sessions-per-day", "40", "--chat-ttl", "7d", "1d"]  # fmt: skip
    assert main(argv, out=lines.append) == 0
    assert len(lines) == 3 and "chat TTL" in lines[0]
    assert lines[1].split()[3] == "7d" and lines[2].split()[3] == "1d"
    assert replace(SimConfig(), warmup_s=1).warmup_s == 1
