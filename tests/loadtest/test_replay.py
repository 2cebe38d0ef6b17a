"""The trace replay's client side: the history it re-sends and where it says sharing broke."""

from __future__ import annotations

from loadtest.replay import ReplayConfig, TraceRecord, _Conversation, sharing_breaks
from loadtest.traces import Segment, TraceSession, Turn


def _record(session: int, turn: int, prompt: int, cached: int, completion: int = 100, **kw):
    return TraceRecord(session, kw.pop("kind", "agent"), turn, 0, 0.0, 0.1, 1.0, prompt, cached,
                       completion, **kw)  # fmt: skip


def test_sharing_breaks_says_where_each_turn_stopped_reusing_the_previous_one() -> None:
    records = [
        _record(0, 0, 1000, 0),
        _record(0, 1, 1300, 1024),  # P + O = 1100: 8 full blocks = 1024: everything reused
        _record(0, 2, 1600, 1152),  # P's blocks end at 1280: broke inside the previous prompt
        _record(1, 0, 1000, 0),
        _record(1, 1, 1300, 512),  # fewer than the previous prompt's 896: broke before it
        _record(2, 0, 600, 0),
        _record(2, 1, 900, 640),  # P + O = 700 → 640 ≥ 640: full
        _record(2, 2, 1200, 768, edit="compact"),  # history rewritten: not compared
    ]
    out = sharing_breaks(records)
    assert out["full"] == 2 and out["before previous answer"] == 2
    assert out["in previous answer"] == 0
    assert out["reusable"] == 1100 + 1400 + 1100 + 700
    assert out["cached"] == 1024 + 1152 + 512 + 640
    assert out["not_cached"] == (1280 - 1152) + (1024 - 512)
    assert out["lost_to_rounding"] == 76 + 120 + 76 + 60
    # An answer that re-tokenises differently: the previous prompt's blocks, not the answer's.
    broke = sharing_breaks([_record(3, 0, 1000, 0, 300), _record(3, 1, 1500, 896)])
    assert broke["in previous answer"] == 1 and broke["not_cached"] == 1280 - 896
    # Chat keeps no output block: the previous prompt less its `<think>` is all it can reuse.
    chat = sharing_breaks(
        [_record(4, 0, 513, 0, kind="chat"), _record(4, 1, 700, 512, kind="chat")]
    )
    assert chat["full"] == 1 and chat["reusable"] == 512
    # A resume slot restores the partial last block too: nothing lost, the sums still add up.
    resumed = sharing_breaks([_record(5, 0, 1000, 0), _record(5, 1, 1300, 1100)])
    assert resumed["full"] == 1 and resumed["cached"] == 1100
    assert resumed["lost_to_rounding"] == 0 and resumed["not_cached"] == 0


def test_the_history_echoes_what_the_server_returned() -> None:
    session = TraceSession(0, "agent", 0.0, Segment("s", 5), True, "high",
                           (Turn(0.0, (Segment("task", 3),), 8, 8),
                            Turn(1.0, (Segment("result", 4),), 8, 8)))  # fmt: skip
    conversation = _Conversation(session)
    conversation.add(session.turns[0])
    body = conversation.body(session.turns[0], ReplayConfig(max_output_tokens=4))
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["max_tokens"] == 4 and body["reasoning_effort"] == "high" and body["tools"]
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    conversation.reply("text", "thought", [call])
    conversation.add(session.turns[1])
    assistant, tool = conversation.messages[2], conversation.messages[3]
    assert assistant == {"role": "assistant", "content": "text", "reasoning_content": "thought",
                         "tool_calls": [call]}  # fmt: skip
    assert tool == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": Segment("result", 4).words(),
    }
    chat = TraceSession(1, "chat", 0.0, Segment("s", 5), False, None, session.turns)
    conversation = _Conversation(chat)
    conversation.add(chat.turns[0])
    conversation.reply("answer", "thought", [])
    assert "reasoning_content" not in conversation.messages[-1]  # chat history drops it
    assert conversation.body(chat.turns[1], ReplayConfig())["thinking"] == {"type": "disabled"}
