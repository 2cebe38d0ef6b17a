"""Engine `Delta`s -> protocol stream events or one accumulated response (`recipe.md` §6, §7).

One `ResponseBridge` per user request. It owns one package `StreamProcessor` per choice (Chat
`n` > 1 runs n engine choices) and closes the gaps of §9/§10 on the way out:

* end-of-sentence ids are stripped before decoding (never in text);
* a stop sequence ends a choice early: `BridgeStep.abort` tells the caller to abort that
  choice's engine request; later deltas of a finished choice are ignored;
* Chat: `usage` leaves the per-choice chunks and, with `stream_options.include_usage`, comes in
  a final chunk with empty `choices` (summed over choices), as OpenAI sends it;
* prompt usage carries the cached prompt tokens given to `start`;
* Responses: reasoning items carry `encrypted_content` sealed by the request's
  `reasoning_sealer` (once complete; null when `include` did not ask for it, not the package's
  `"{id}-{n}"` placeholder), and the response object echoes `prompt_cache_key`.
* Messages `thinking.display: "omitted"` (`PreparedRequest.is_thinking_shown`): thinking blocks
  keep their start, signature and stop but no `thinking_delta`, and their text is empty; the
  signature seals the text, so a block sent back restores its reasoning.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import deepseek_recipe as dr

from engine.outputs import Delta, TokenLogprob
from engine.request import FinishReason
from recipe.convert import PreparedRequest
from recipe.cut_tool_calls import CutToolCalls
from recipe.errors import Protocol, RecipeError
from recipe.tokenizer import ModelTokenizer

DONE = "[DONE]"

_FINISH_REASONS = {
    FinishReason.STOP: dr.InferenceFinishReason.Stop,
    FinishReason.LENGTH: dr.InferenceFinishReason.Length,
}
_REASONING_STAGES = (
    dr.ThinkingInitialStage.ReasoningStart,
    dr.ThinkingInitialStage.ReasoningContinuation,
)
_RESPONSE_TYPES: dict[Protocol, Any] = {
    Protocol.CHAT: dr.ChatCompletionResponse,
    Protocol.RESPONSES: dr.ResponsesResponse,
    Protocol.MESSAGES: dr.MessagesResponse,
}


@dataclass(frozen=True)
class StreamEvent:
    """One SSE message: `event` name (None for Chat's data-only messages) and `data`, a JSON
    object, or the string `[DONE]` that ends a Chat stream."""

    event: str | None
    data: dict[str, Any] | str


@dataclass(frozen=True)
class BridgeStep:
    """What one `push` produced. abort: the choice ended early (a stop sequence); abort the
    engine request that sent the delta."""

    events: list[StreamEvent] = field(default_factory=list)
    abort: bool = False


class _Choice:
    """One choice: its stream processor and its accumulated response."""

    def __init__(self, prepared: PreparedRequest, tokenizer: ModelTokenizer, ids: _Ids) -> None:
        request_type = _generator_factory(prepared.protocol)
        generator = request_type(prepared.conversation_request, ids.response_id, prepared.model)
        if prepared.protocol is Protocol.RESPONSES:
            if prepared.echo is not None:
                generator = generator.with_echo(prepared.echo)
            if prepared.namespace_tool_map:
                generator = generator.with_namespace_tool_map(prepared.namespace_tool_map)
        self.processor = dr.StreamProcessor(generator, prepared.parsing_options, tokenizer.native)
        self.response = _RESPONSE_TYPES[prepared.protocol](
            ids.response_id,
            prepared.model,
            ids.created,
            prepared.num_prompt_tokens,
            ids.num_cached_tokens,
        )
        self.usage: dict[str, Any] | None = None
        self.is_done = False
        self.num_tokens = 0  # every token the engine generated for this choice, EOS included
        self.num_reasoning_tokens = 0  # tokens before the end of the reasoning (markers not)
        self.is_reasoning = prepared.parsing_options.thinking_initial_stage in _REASONING_STAGES
        self.is_in_tool_calls = prepared.parsing_options.starts_in_tool_calls
        self.tool_logprobs: list[dict[str, Any]] = []  # Chat: entries of tool-call tokens
        self.num_unsent_tool_logprobs = 0  # the tail of `tool_logprobs` no chunk carried yet
        self.cut_calls = CutToolCalls(prepared.protocol)  # a call cut by the output limit
        self.hidden_thinking: dict[int, str] = {}  # omitted thinking text by content block


@dataclass(frozen=True)
class _Ids:
    response_id: str
    created: int
    num_cached_tokens: int


def _generator_factory(protocol: Protocol) -> Any:
    return {
        Protocol.CHAT: dr.ChatCompletionRequest.chunk_generator,
        Protocol.RESPONSES: dr.ResponsesRequest.chunk_generator,
        Protocol.MESSAGES: dr.MessagesRequest.chunk_generator,
    }[protocol]


class ResponseBridge:
    """Feeds one request's engine deltas into the package and yields protocol events.

    Call `start` once (the role chunk / `response.created` / `message_start`), then `push`
    every `Delta` until `is_finished`; then `response()` is the non-streaming body. Events are
    returned for streaming; accumulation happens either way.
    """

    def __init__(
        self,
        prepared: PreparedRequest,
        tokenizer: ModelTokenizer,
        response_id: str,
        created: int | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        self.prepared = prepared
        self._eos_id = tokenizer.eos_token_id
        ends = [tokenizer.special_ids[tokenizer.special_tokens.token(dr.SpecialToken.ThinkingEnd)]]
        if prepared.parsing_options.parse_tool_calls:
            ends.append(tokenizer.dsml_token_id)  # a tool call ends the reasoning too
        self._reasoning_end_ids = frozenset(ends)
        self._tokenizer = tokenizer
        self._response_type = _RESPONSE_TYPES[prepared.protocol]
        self._ids = _Ids(
            response_id, int(time.time()) if created is None else created, num_cached_tokens
        )
        self._choices = [
            _Choice(prepared, tokenizer, self._ids) for _ in range(prepared.sampling_params.n)
        ]
        self._is_started = False
        self._is_closed = False

    @property
    def is_finished(self) -> bool:
        """Every choice has finished (the final events were returned)."""
        return self._is_closed

    def start(self) -> list[StreamEvent]:
        """The opening events (the backend is ready, the prompt is counted)."""
        if self._is_started:
            return []
        self._is_started = True
        usage = dr.PromptUsage(
            prompt_tokens=self.prepared.num_prompt_tokens,
            prompt_cache_hit_tokens=self._ids.num_cached_tokens,
        )
        events: list[StreamEvent] = []
        for index, choice in enumerate(self._choices):
            events += self._emit(
                index, choice.processor.push(dr.InferenceChunk.ready(prompt_usage=usage))
            )
        return events

    def push(self, delta: Delta) -> BridgeStep:
        """Feed one engine delta (any number of tokens, optionally a finish reason).

        Raises:
            RecipeError: 500 when the engine aborted the request (`delta.error` says why) or
                the package could not process the output.
        """
        events = self.start()
        if not 0 <= delta.index < len(self._choices):
            raise RecipeError(
                500, f"delta for unknown choice {delta.index}", self.prepared.protocol
            )
        choice = self._choices[delta.index]
        if choice.is_done or self._is_closed:
            return BridgeStep(events)
        if delta.finish_reason is FinishReason.ABORT:
            choice.processor.close()
            self._is_closed = True
            raise RecipeError(500, delta.error or "request aborted", self.prepared.protocol)
        try:
            token_events = self._push_tokens(delta, choice)
            choice.cut_calls.observe(token_events)
            events += token_events
            stopped_early = choice.processor.finished
            closing: list[StreamEvent] = []
            if delta.finish_reason is not None and not stopped_early:
                finish = dr.InferenceChunk.finish(_FINISH_REASONS[delta.finish_reason])
                closing += self._emit(delta.index, choice.processor.push(finish))
            if choice.processor.finished or delta.finish_reason is not None:
                closing += self._emit(delta.index, choice.processor.finish())
                choice.is_done = True
            if delta.finish_reason is FinishReason.LENGTH and not stopped_early:
                closing = choice.cut_calls.cut(closing)
            events += closing
            _attach_tool_logprobs(events, delta.index, choice)
        except RuntimeError as exc:
            self._is_closed = True
            raise RecipeError(
                500, f"output processing failed: {exc}", self.prepared.protocol
            ) from exc
        if choice.is_done and all(c.is_done for c in self._choices):
            events += self._closing_events()
            self._is_closed = True
        return BridgeStep(events, abort=stopped_early and delta.finish_reason is None)

    def response(self) -> dict[str, Any]:
        """The accumulated non-streaming body (Chat choices merged, usage summed)."""
        bodies = [json.loads(choice.response.to_json()) for choice in self._choices]
        for choice, one in zip(self._choices, bodies, strict=True):
            _set_usage(self.prepared.protocol, one, choice, is_body=True)
            if self.prepared.protocol is not Protocol.CHAT:
                choice.cut_calls.patch_body(one)
            else:
                choice.cut_calls.patch_body(one["choices"][0])
        body = bodies[0]
        if self.prepared.protocol is Protocol.RESPONSES:
            _finish_response_object(body, self.prepared)
        if not self.prepared.is_thinking_shown:
            _omit_thinking_text(body, self.prepared)
        if self.prepared.protocol is not Protocol.CHAT:
            return body
        body["choices"] = [
            {**entry, "index": index}
            for index, other in enumerate(bodies)
            for entry in other["choices"]
        ]
        for entry, choice in zip(body["choices"], self._choices, strict=True):
            if choice.tool_logprobs:
                logprobs = entry.get("logprobs") or {"content": None, "refusal": None}
                logprobs["content"] = (logprobs.get("content") or []) + choice.tool_logprobs
                entry["logprobs"] = logprobs
        body["usage"] = self._total_usage([b.get("usage") for b in bodies])
        return body

    # ----------------------------------------------------------------------------- helpers

    def _push_tokens(self, delta: Delta, choice: _Choice) -> list[StreamEvent]:
        """Push a delta's tokens into the choice's processor. EOS ids are not parsed (they are
        no text) but still count as generated tokens in usage, as every token the engine
        produced does (`ignore_eos` may sample EOS mid-answer).

        NOTE: the package's own count is not used for EOS: a text chunk's `token_count`
        replaces the count of the current stage instead of adding to it, so usage is set from
        `choice.num_tokens` (`_set_usage`)."""
        choice.num_tokens += len(delta.token_ids)
        self._count_reasoning(delta.token_ids, choice)
        token_ids = delta.token_ids
        kept: Sequence[int] = range(len(token_ids))
        if self._eos_id in token_ids:
            kept = [i for i, token_id in enumerate(token_ids) if token_id != self._eos_id]
            token_ids = [token_ids[i] for i in kept]
        if not token_ids:
            return []
        logprobs = None
        if delta.logprobs is not None:
            if len(delta.logprobs) != len(delta.token_ids):
                raise RuntimeError(
                    f"{len(delta.logprobs)} logprobs for {len(delta.token_ids)} tokens"
                )
            logprobs = [_native_logprob(delta.logprobs[i]) for i in kept]
            self._record_tool_logprobs(token_ids, [delta.logprobs[i] for i in kept], choice)
        chunk = dr.InferenceChunk.tokens(token_ids, logprobs)
        return self._emit(delta.index, choice.processor.push(chunk))

    def _record_tool_logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprob], choice: _Choice
    ) -> None:
        """Chat: logprob entries for the tokens of tool-call markup (from the marker that opens
        it on), which the package leaves without any, so a tool-call choice keeps `logprobs`
        (as vLLM reports every output token)."""
        if self.prepared.protocol is not Protocol.CHAT:
            return
        if not self.prepared.parsing_options.parse_tool_calls:
            return
        for token_id, entry in zip(token_ids, logprobs, strict=True):
            if token_id == self._tokenizer.dsml_token_id:
                choice.is_in_tool_calls = True
            if choice.is_in_tool_calls:
                choice.tool_logprobs.append(_logprob_entry(self._tokenizer, entry))
                choice.num_unsent_tool_logprobs += 1

    def _count_reasoning(self, token_ids: list[int], choice: _Choice) -> None:
        """Reasoning tokens: those generated before `</think>` (or the tool-call marker that
        ends reasoning), EOS and the markers excluded. NOTE: the package's own count (tokens
        that emitted reasoning text) can exceed the tokens generated, so it is not used."""
        for token_id in token_ids:
            if not choice.is_reasoning:
                return
            if token_id in self._reasoning_end_ids:
                choice.is_reasoning = False
            elif token_id != self._eos_id:
                choice.num_reasoning_tokens += 1

    def _emit(self, index: int, native_events: list[Any]) -> list[StreamEvent]:
        choice = self._choices[index]
        events = []
        for native in native_events:
            data = json.loads(native.to_json())
            name = self._response_type.sse_event_name(native)
            choice.response.accumulate(native)  # NOTE: consumes `native`
            _set_usage(self.prepared.protocol, data, choice)
            if self.prepared.protocol is Protocol.RESPONSES:
                _finish_response_event(data, self.prepared)
            if self.prepared.protocol is Protocol.CHAT:
                for entry in data.get("choices", ()):
                    entry["index"] = index
                if data.get("usage") is not None:
                    choice.usage = data["usage"]
                data["usage"] = None
            if not self.prepared.is_thinking_shown and _hide_thinking(data, choice, self.prepared):
                continue
            events.append(StreamEvent(name, data))
        return events

    def _closing_events(self) -> list[StreamEvent]:
        if self.prepared.protocol is not Protocol.CHAT:
            return []
        events = []
        if self.prepared.include_usage:
            usage = self._total_usage([c.usage for c in self._choices])
            events.append(
                StreamEvent(
                    None,
                    {
                        "id": self._ids.response_id,
                        "object": "chat.completion.chunk",
                        "created": self._ids.created,
                        "model": self.prepared.model,
                        "system_fingerprint": None,
                        "choices": [],
                        "usage": usage,
                    },
                )
            )
        events.append(StreamEvent(None, DONE))
        return events

    def _total_usage(self, usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        """Chat usage summed over choices (the prompt counted once)."""
        present = [u for u in usages if u]
        if not present:
            return None
        total = json.loads(json.dumps(present[0]))
        completion = sum(u.get("completion_tokens", 0) for u in present)
        total["completion_tokens"] = completion
        total["total_tokens"] = total.get("prompt_tokens", 0) + completion
        if "completion_tokens_details" in total:
            total["completion_tokens_details"]["reasoning_tokens"] = sum(
                (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
                for u in present
            )
        return total


def _finish_response_event(data: dict[str, Any], prepared: PreparedRequest) -> None:
    """A Responses event as this server sends it (see the module docstring)."""
    if isinstance(data.get("response"), dict):
        _finish_response_object(data["response"], prepared)
    if isinstance(data.get("item"), dict):
        _seal_reasoning(data["item"], prepared)


def _finish_response_object(response: dict[str, Any], prepared: PreparedRequest) -> None:
    response["prompt_cache_key"] = prepared.prompt_cache_key
    for item in response.get("output") or ():
        _seal_reasoning(item, prepared)


def _seal_reasoning(item: dict[str, Any], prepared: PreparedRequest) -> None:
    if item.get("type") != "reasoning":
        return
    sealer = prepared.reasoning_sealer
    if sealer is None or item.get("status") == "in_progress":
        item["encrypted_content"] = None
        return
    text = "".join(
        part.get("text", "") for part in item.get("content") or () if isinstance(part, dict)
    )
    item["encrypted_content"] = sealer.seal(text)


def _hide_thinking(data: dict[str, Any], choice: _Choice, prepared: PreparedRequest) -> bool:
    """Messages `display: "omitted"` streaming: True for a thinking delta, which is dropped
    (its text kept on the choice); a thinking block's signature then seals that text."""
    if data.get("type") != "content_block_delta":
        return False
    delta = data["delta"]
    index = data.get("index")
    if delta.get("type") == "thinking_delta":
        choice.hidden_thinking[index] = choice.hidden_thinking.get(index, "") + delta["thinking"]
        return True
    if delta.get("type") == "signature_delta" and prepared.reasoning_sealer is not None:
        delta["signature"] = prepared.reasoning_sealer.seal(choice.hidden_thinking.pop(index, ""))
    return False


def _omit_thinking_text(body: dict[str, Any], prepared: PreparedRequest) -> None:
    """Empty the text of a Messages body's thinking blocks; their signature seals it, so the
    reasoning comes back when the client returns the block (`convert._open_sealed_thinking`)."""
    for block in body.get("content") or ():
        if block.get("type") == "thinking":
            if prepared.reasoning_sealer is not None:
                block["signature"] = prepared.reasoning_sealer.seal(block["thinking"])
            block["thinking"] = ""


def _native_logprob(entry: TokenLogprob) -> tuple[float, list[tuple[int, float]]]:
    return entry.logprob, [(token_id, logprob) for token_id, logprob in entry.top]


def _set_usage(
    protocol: Protocol, data: dict[str, Any], choice: _Choice, is_body: bool = False
) -> None:
    """Set the output and reasoning token counts of the usage in `data` (an event or a response
    body) to the choice's own counts of what the engine generated."""
    if protocol is Protocol.RESPONSES and not is_body:
        data = data.get("response") or {}
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return
    if protocol is Protocol.MESSAGES:
        if "output_tokens" in usage:
            usage["output_tokens"] = choice.num_tokens
        return
    output, details, prompt = _USAGE_KEYS[protocol]
    usage[output] = choice.num_tokens
    usage["total_tokens"] = usage.get(prompt, 0) + choice.num_tokens
    if isinstance(usage.get(details), dict):
        usage[details]["reasoning_tokens"] = choice.num_reasoning_tokens


_USAGE_KEYS = {
    Protocol.CHAT: ("completion_tokens", "completion_tokens_details", "prompt_tokens"),
    Protocol.RESPONSES: ("output_tokens", "output_tokens_details", "input_tokens"),
}


def _attach_tool_logprobs(events: list[StreamEvent], index: int, choice: _Choice) -> None:
    """Put the tool-call logprob entries no chunk carried yet on the last Chat chunk of
    choice `index` in `events` (kept for a later chunk when there is none)."""
    if not choice.num_unsent_tool_logprobs:
        return
    for event in reversed(events):
        entries = event.data.get("choices") if isinstance(event.data, dict) else None
        if entries and entries[0].get("index") == index:
            logprobs = entries[0].get("logprobs") or {"content": None, "refusal": None}
            unsent = choice.tool_logprobs[-choice.num_unsent_tool_logprobs :]
            logprobs["content"] = (logprobs.get("content") or []) + unsent
            entries[0]["logprobs"] = logprobs
            choice.num_unsent_tool_logprobs = 0
            return


def _logprob_entry(tokenizer: ModelTokenizer, entry: TokenLogprob) -> dict[str, Any]:
    """One Chat logprob entry in the package's shape (`token`, `logprob`, `bytes`,
    `top_logprobs`)."""
    return {
        **_token_entry(tokenizer, entry.token_id, entry.logprob),
        "top_logprobs": [_token_entry(tokenizer, i, lp) for i, lp in entry.top],
    }


def _token_entry(tokenizer: ModelTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    data = tokenizer.token_bytes(token_id)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: escaped bytes, as the package writes them
        text = "".join(f"\\x{byte:02x}" for byte in data)
    return {"token": text, "logprob": logprob, "bytes": list(data)}
