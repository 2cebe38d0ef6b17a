"""Seeded traces: deterministic, shaped as `cache.md` §5.1 says (shared system prompts, growing
histories, chat revisits past a week)."""

from __future__ import annotations

from dataclasses import replace

from loadtest.traces import AgentTraceConfig, ChatTraceConfig, History, agent_trace, chat_trace

AGENTS = AgentTraceConfig(seed=3, num_sessions=40, session_rate=0.1)
CHATS = ChatTraceConfig(seed=3, num_sessions=300, session_rate=1.0)


def test_traces_are_deterministic_by_seed_and_prefix_stable_in_length() -> None:
    assert agent_trace(AGENTS) == agent_trace(AGENTS)
    assert chat_trace(CHATS) == chat_trace(CHATS)
    assert agent_trace(AGENTS) != agent_trace(replace(AGENTS, seed=4))
    # A longer trace starts with the shorter one's sessions.
    assert agent_trace(replace(AGENTS, num_sessions=60))[:40] == agent_trace(AGENTS)
    first = agent_trace(AGENTS)[0]
    assert first.turns[0].add[0].words() == first.turns[0].add[0].words()
    assert len(first.system.words().split()) == first.system.num_tokens
    assert (first.system.token_ids() == first.system.token_ids()).all()


def test_agent_sessions_share_system_prompts_and_grow_turn_by_turn() -> None:
    sessions = agent_trace(AGENTS)
    systems = [s.system for s in sessions]
    assert len(set(systems)) < len(sessions) / 2  # Zipf over types × efforts: shared
    assert all(
        AGENTS.system_tokens_min <= s.num_tokens <= AGENTS.system_tokens_max for s in systems
    )
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and starts[0] == 0 and starts[-1] > 0
    assert sum(len(s.turns) for s in sessions) / len(sessions) > 10  # geometric, mean 30
    for session in sessions:
        assert session.traffic_class == "agent" and session.tools
        history, last = History(session), 0
        for index, turn in enumerate(session.turns):
            prompt = history.advance(index)
            length = sum(s.num_tokens for s in prompt)
            assert prompt[0] == session.system
            if turn.edit is None:
                assert length > last  # the whole history plus a tool result
            history.answer(index)
            last = length + turn.answer_tokens
            assert turn.answer_tokens == turn.output_tokens  # reasoning stays with tools
            assert (index == 0) == (turn.think_s == 0)


def test_chat_sessions_revisit_after_heavy_tailed_pauses_and_keep_only_answers() -> None:
    sessions = chat_trace(CHATS)
    assert all(s.traffic_class == "chat" and not s.tools for s in sessions)
    revisits = [t.think_s for s in sessions for t in s.turns if t.revisit]
    assert len(revisits) > 0.2 * len(sessions)
    week = 7 * 86400
    assert any(pause > week for pause in revisits) and any(pause < 86400 for pause in revisits)
    assert max(revisits) <= CHATS.revisit_max_s
    efforts = {s.effort for s in sessions}
    assert efforts == {None, "low", "high", "max"}
    # Each effort is its own copy of a system prompt (the effort line comes first).
    assert len({s.system.seed for s in sessions}) > CHATS.num_variants
    thinking = [t for s in sessions if s.effort for t in s.turns]
    assert all(t.answer_tokens < t.output_tokens or t.output_tokens == 1 for t in thinking)
