"""Tool calls cut by the output limit: the arguments the model had written (issue 12.3).

When `max_tokens` ends a choice inside a DSML invoke, the package reports the call with the
argument text it had streamed, plus (at the finish) any text it held back, and nothing for a
call whose header is out but whose first parameter has not started. `CutToolCalls` watches one
choice's events and, at a length finish, rewrites them so that every cut call carries:

* Chat / Responses `arguments`: the longest text that every completion of the generated tokens
  would start with, i.e. a faithful JSON prefix of the arguments the model was writing:
  `{` once the invoke is open (its name closed), `{"ci` inside a parameter name, `{"city": "Li`
  inside a value. Text the package held back because it may begin the closing tag (`</`) is
  not part of it (a completion may make it markup), so it is dropped, from the stream and from
  the body alike. Streamed argument deltas concatenate to the body's `arguments`.
* Messages: the same text as `input_json_delta` pieces; the body's `tool_use.input` (an
  object) holds the parameters known complete: a string value once its closing quote is out
  (the package writes it only at the parameter's closing tag), any value once the next
  parameter or the end of the call follows. The partial last parameter is left out.

A call whose name is still open at the cut is not reported (the package emits its header only
once the name is closed). Calls before the open one are complete and left alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from recipe.errors import Protocol


@dataclass
class _Call:
    arguments: str = ""
    item_id: str | None = None  # Responses: the function_call item's id


class CutToolCalls:
    """One choice's tool-call argument text as streamed, and the rewrite at a length finish.

    Call `observe` with every event emitted before the finish, `cut` with the events of a
    length finish (returns the events to send), and `patch_body` on the accumulated body.
    """

    def __init__(self, protocol: Protocol) -> None:
        self._protocol = protocol
        self._calls: dict[int, _Call] = {}  # by Chat tool-call index / output or block index
        self._open: int | None = None  # the call that was open at a cut

    @property
    def is_cut(self) -> bool:
        """A call was open when a length finish came."""
        return self._open is not None

    def observe(self, events: list[Any]) -> None:
        """Record the call headers and argument deltas in `events` (not mutated)."""
        for event in events:
            for key, piece, item_id in _argument_pieces(self._protocol, event):
                call = self._calls.setdefault(key, _Call())
                call.arguments += piece
                call.item_id = item_id or call.item_id

    def cut(self, events: list[Any]) -> list[Any]:
        """The events of a length finish, rewritten for the call that was open: the argument
        text the package flushes at the finish loses a trailing `<` / `</` (it may begin the
        closing tag), and a call with no argument text yet gets `{`. Unchanged when no call
        was open.

        NOTE: only the last call can be open; a complete call's arguments end in `}` (the
        package writes `{}` for a call without parameters) with nothing left open."""
        if not self._calls:
            return events
        key = max(self._calls)
        call = self._calls[key]
        if _is_closed(call.arguments):
            return events
        self._open = key
        flushed = "".join(
            piece
            for event in events
            for k, piece, _ in _argument_pieces(self._protocol, event)
            if k == key
        )
        tail = _without_tag_start(flushed)
        if not call.arguments and not tail:
            tail = "{"
        call.arguments += tail
        return _REWRITES[self._protocol](events, key, call, tail)

    def patch_body(self, body: dict[str, Any]) -> None:
        """Set the cut call's arguments (Messages: `input`) in the accumulated body: a Chat
        choice entry, a Responses response or a Messages message."""
        if self._open is None:
            return
        call = self._calls[self._open]
        if self._protocol is Protocol.CHAT:
            for entry in body["message"].get("tool_calls") or ():
                if entry.get("index") == self._open:
                    entry["function"]["arguments"] = call.arguments
        elif self._protocol is Protocol.RESPONSES:
            _patch_output(body.get("output") or (), call)
        else:
            block = body["content"][self._open]
            block["input"] = complete_parameters(call.arguments)


def complete_parameters(arguments: str) -> dict[str, Any]:
    """The parameters known complete in the argument text of a cut call (`{"a": 1, "b": "x`):
    those followed by `, ` or `}`, and a last one whose value is a string (its closing quote
    comes only with the parameter's closing tag). Stops at the first member that does not
    parse (a non-string value is copied verbatim by the package, so may be invalid)."""
    decoder = json.JSONDecoder()
    members: dict[str, Any] = {}
    if not arguments.startswith("{"):
        return members
    pos = 1
    while True:
        try:
            key, pos = decoder.raw_decode(arguments, pos)
            if not isinstance(key, str) or arguments[pos : pos + 2] != ": ":
                return members
            value, end = decoder.raw_decode(arguments, pos + 2)
        except json.JSONDecodeError:
            return members
        rest = arguments[end:]
        if rest.startswith(", ") or rest.startswith("}") or not rest and isinstance(value, str):
            members[key] = value
        if not rest.startswith(", "):
            return members
        pos = end + 2


def _without_tag_start(text: str) -> str:
    """`text` without a trailing `<` or `</`: what may begin a closing `</｜DSML｜` tag."""
    for start in ("</", "<"):
        if text.endswith(start):
            return text[: -len(start)]
    return text


def _is_closed(arguments: str) -> bool:
    """The invoke closed: the text ends in `}` with no `{`/`[` left open outside strings (a
    verbatim non-string value may end in `}` too, `{"a": {"b": 1}`, and is still open)."""
    return arguments.endswith("}") and _depth(arguments) == 0


def _depth(text: str) -> int:
    """Unmatched `{`/`[` outside strings."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
    return depth


# ------------------------------------------------------------------ per-protocol events


def _argument_pieces(protocol: Protocol, event: Any) -> list[tuple[int, str, str | None]]:
    """(call key, argument text, Responses item id) of each header or argument delta."""
    data = event.data
    if not isinstance(data, dict):
        return []
    if protocol is Protocol.CHAT:
        return [
            (call["index"], call["function"].get("arguments") or "", None)
            for entry in data.get("choices") or ()
            for call in entry["delta"].get("tool_calls") or ()
        ]
    if protocol is Protocol.RESPONSES:
        if event.event == "response.output_item.added":
            item = data["item"]
            if item["type"] == "function_call":
                return [(data["output_index"], item.get("arguments") or "", item["id"])]
        elif event.event == "response.function_call_arguments.delta":
            return [(data["output_index"], data["delta"], None)]
        return []
    if event.event == "content_block_start" and data["content_block"]["type"] == "tool_use":
        return [(data["index"], "", None)]
    if event.event == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
        return [(data["index"], data["delta"]["partial_json"], None)]
    return []


def _is_argument_delta(protocol: Protocol, event: Any, key: int) -> bool:
    return any(k == key for k, _, _ in _argument_pieces(protocol, event))


def _rewrite_chat(events: list[Any], key: int, call: _Call, tail: str) -> list[Any]:
    out = []
    for event in events:
        data = event.data
        if isinstance(data, dict):
            for entry in data.get("choices") or ():
                delta = entry["delta"]
                kept = [c for c in delta.get("tool_calls") or () if c["index"] != key]
                if "tool_calls" in delta:
                    delta["tool_calls"] = kept
                    if not kept:
                        del delta["tool_calls"]
                if tail and entry.get("finish_reason") is not None:
                    delta["tool_calls"] = [{"index": key, "function": {"arguments": tail}}]
            if data.get("choices") and all(_is_empty_chunk(e) for e in data["choices"]):
                continue
        out.append(event)
    return out


def _is_empty_chunk(entry: dict[str, Any]) -> bool:
    return not entry["delta"] and entry.get("finish_reason") is None and not entry.get("logprobs")


def _rewrite_responses(events: list[Any], key: int, call: _Call, tail: str) -> list[Any]:
    out = []
    for event in events:
        if _is_argument_delta(Protocol.RESPONSES, event, key):
            continue
        data = event.data
        if event.event == "response.function_call_arguments.done" and data["item_id"] == (
            call.item_id
        ):
            if tail:
                out.append(
                    type(event)(
                        "response.function_call_arguments.delta",
                        {
                            "type": "response.function_call_arguments.delta",
                            "delta": tail,
                            "item_id": call.item_id,
                            "output_index": key,
                            "sequence_number": data["sequence_number"],
                        },
                    )
                )
            data["arguments"] = call.arguments
        elif event.event == "response.output_item.done":
            _patch_output([data["item"]], call)
        elif isinstance(data, dict) and isinstance(data.get("response"), dict):
            _patch_output(data["response"].get("output") or (), call)
        out.append(event)
    first = next((e.data["sequence_number"] for e in events), None)
    for number, event in enumerate(out, start=first or 0):
        event.data["sequence_number"] = number
    return out


def _patch_output(items: Any, call: _Call) -> None:
    for item in items:
        if item.get("type") == "function_call" and item.get("id") == call.item_id:
            item["arguments"] = call.arguments


def _rewrite_messages(events: list[Any], key: int, call: _Call, tail: str) -> list[Any]:
    out = []
    for event in events:
        if _is_argument_delta(Protocol.MESSAGES, event, key):
            continue
        if tail and event.event == "content_block_stop" and event.data["index"] == key:
            out.append(
                type(event)(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": key,
                        "delta": {"type": "input_json_delta", "partial_json": tail},
                    },
                )
            )
        out.append(event)
    return out


_REWRITES = {
    Protocol.CHAT: _rewrite_chat,
    Protocol.RESPONSES: _rewrite_responses,
    Protocol.MESSAGES: _rewrite_messages,
}
