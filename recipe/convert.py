"""Protocol request bodies -> `PreparedRequest` (prompt ids, sampling, parsing) (`recipe.md` §5).

The package parses, validates and renders; around it this module closes the gaps of §9/§10:
Chat `developer` -> system, `max_completion_tokens` honoured, `n` > 1 run as n engine choices,
`logit_bias` (every protocol, ids checked against the vocabulary) / penalties forwarded,
Responses `stop` honoured and `previous_response_id` / `store` / `background` refused,
Messages `top_k` forwarded, output constraints turned into a grammar (`recipe/constraints.py`:
Messages `tool_choice: any` and `output_config.format`, Chat grammar extensions,
`parallel_tool_calls`), images refused with a 400. Thinking (`_pop_thinking_options`): Messages
without `thinking` do not think (Anthropic's rule; the package would), `thinking.budget_tokens`
is enforced by the engine (`engine/thinking_budget.py`), Messages `thinking.display: "omitted"`
returns thinking blocks without their text, Chat `chat_template_kwargs` (vLLM's) switch thinking.

Coding agents (issue 14): Responses `include: ["reasoning.encrypted_content"]` seals each
reasoning item (`recipe/sealing.py`) and sealed items in `input` are opened back into reasoning
text; `prompt_cache_key` is echoed and becomes the engine request's affinity key;
`client_metadata` is validated; Messages `context_management` accepts `clear_thinking` edits.
The server's `default_max_tokens` / `max_tokens_limit` apply to every protocol.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import deepseek_recipe as dr
import numpy as np

from engine.sampling_params import SamplingParams
from engine.structured.grammar import GrammarSpec
from engine.thinking_budget import ThinkingBudget
from recipe.constraints import (
    ConstraintOptions,
    OutputConstraint,
    effective_constraint,
    grammar_spec,
    messages_options,
    pop_chat_extensions,
    pop_responses_options,
    relaxed_tool_choice,
)
from recipe.errors import Protocol, RecipeError
from recipe.fields import take_fields, with_sampling_fields
from recipe.sealing import ReasoningSealer, SealError
from recipe.tokenizer import ModelTokenizer

MAX_CHOICES = 16
MAX_STOP_SEQUENCES = 4


@dataclass(frozen=True)
class RecipeConfig:
    """model_names: the names requests may use (all render as V4.1-Flash); context_len: the
    model's context length; default_thinking_mode: thinking when a request does not say;
    vocab_size: the model's logits width, the bound on client token ids (`logit_bias`);
    None = the tokenizer's vocabulary.

    default_max_tokens: output tokens of a request that sets none (None: the rest of the
    context), always lowered to the context left; max_tokens_limit: the most a request may ask
    for (None: the package's bound, 393216): Chat and Responses answer 400 above it, Messages
    lowers it (as the package does).

    traffic_classes: the values `traffic_class` may take (the `--kv-ttl` classes).
    """

    model_names: tuple[str, ...]
    context_len: int
    default_thinking_mode: bool = True
    vocab_size: int | None = None
    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None
    traffic_classes: tuple[str, ...] = ("agent", "chat")

    def __post_init__(self) -> None:
        if not self.model_names:
            raise ValueError("model_names must not be empty")
        if self.context_len < 2:
            raise ValueError("context_len must be >= 2")
        for name in ("default_max_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True)
class PreparedRequest:
    """Everything the server and the bridge need from one protocol request.

    model: the requested name (echoed in responses); thinking: whether thinking mode is on;
    include_usage: Chat `stream_options.include_usage` (a final usage chunk);
    conversation_request: the package's converted request (chunk generators are made from it);
    parsing_options: the stream parser settings, stop sequences included (Responses too);
    echo / namespace_tool_map: Responses only; output_constraint: what the output must
    follow, and grammar: its compiled form's spec (both None when unconstrained);
    is_thinking_shown: False when the reasoning is generated but its text is not returned
    (Messages `thinking.display: "omitted"`: thinking blocks with empty text and a signature);
    reasoning_sealer: Responses asking for `reasoning.encrypted_content` (the bridge seals each
    reasoning item with it) and Messages with omitted thinking (it seals each thinking block's
    text into its signature), else None; prompt_cache_key: Responses, echoed in the response.
    """

    protocol: Protocol
    model: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    parsing_options: dr.ParsingOptions
    conversation_request: dr.ConversationRequest
    stream: bool
    include_usage: bool
    thinking: bool
    output_constraint: OutputConstraint | None = None
    grammar: GrammarSpec | None = None
    echo: dr.ResponsesEcho | None = None
    namespace_tool_map: dict[str, tuple[str, str]] | None = None
    reasoning_sealer: ReasoningSealer | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None  # the vLLM extension: prefix-cache isolation (all APIs)
    is_thinking_shown: bool = True
    traffic_class: str = "chat"  # the KV cache TTL class: `agent` when tools are declared

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class ThinkingOptions:
    """What a request's `thinking` object asks beyond on / off (the package reads only that).

    budget_tokens: reasoning tokens at most (`thinking: {"type": "enabled", "budget_tokens": N}`),
    None = no limit; is_shown: the reasoning text is returned (Messages `display`).
    """

    budget_tokens: int | None = None
    is_shown: bool = True


@dataclass(frozen=True)
class _OutputRules:
    """Token-level rules for the engine: ids never sampled, and the thinking budget."""

    banned_token_ids: tuple[int, ...] = ()
    thinking_budget: ThinkingBudget | None = None


@dataclass
class _Extras:
    """Fields our layer handles itself, taken from the body before the package sees it."""

    n: int = 1
    logit_bias: dict[int, float] | None = None
    top_k: int = 0
    stop: list[str] | None = None
    include_usage: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    constraints: ConstraintOptions = field(default_factory=ConstraintOptions)
    include_encrypted_reasoning: bool = False
    prompt_cache_key: str | None = None
    thinking: ThinkingOptions = field(default_factory=ThinkingOptions)


class Recipe:
    """Converts protocol request bodies into `PreparedRequest`s for one model.

    reasoning_sealer: seals and opens Responses `encrypted_content` (default: a random key,
    so sealed reasoning opens only in this process).
    """

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        config: RecipeConfig,
        reasoning_sealer: ReasoningSealer | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self._sealer = reasoning_sealer or ReasoningSealer.random()
        names = {name: dr.ModelVersion.DeepseekV41Flash for name in config.model_names}
        options = (
            dr.ConversionOptions(default_thinking_mode=config.default_thinking_mode)
            .with_model_versions_by_name(names)
            .with_special_tokens(tokenizer.special_tokens)
        )
        if config.max_tokens_limit is not None:
            options = options.with_thinking_max_tokens_upper_bound(
                config.max_tokens_limit
            ).with_non_thinking_max_tokens_upper_bound(config.max_tokens_limit)
        self._options = options
        self._encoding = dr.DeepseekV41Encoding().with_special_tokens(tokenizer.special_tokens)
        self._vocab_size = config.vocab_size or tokenizer.full.get_vocab_size(True)

    def prepare(
        self, protocol: Protocol, body: Any, traffic_class_header: str | None = None
    ) -> PreparedRequest:
        """Parse, validate, render and encode one request body (a JSON object as a dict).

        traffic_class_header: the `X-Deepinfer-Traffic-Class` header; the body's
        `traffic_class` field wins over it; without either, `agent` if the request declares
        tools, else `chat`.

        Raises:
            RecipeError: 400 for anything the request gets wrong or asks for that is not
                supported yet; the message says which.
        """
        if not isinstance(body, dict):
            raise RecipeError(400, "request body must be a JSON object", protocol)
        body = copy.deepcopy(body)
        sampling_fields = take_fields(protocol, body)  # unknown fields are a 400
        if protocol is Protocol.RESPONSES:
            _open_sealed_reasoning(body, self._sealer, protocol)
        if protocol is Protocol.MESSAGES:
            _open_sealed_thinking(body, self._sealer)
        cache_salt = _pop_cache_salt(body, protocol)
        traffic_class = self._traffic_class(body, traffic_class_header, protocol)
        extras = _PREPROCESSORS[protocol](body, protocol)
        bias = body.pop("logit_bias", None)  # every protocol (an extension outside Chat)
        if bias is not None:
            extras.logit_bias = _parse_logit_bias(bias, protocol, self._vocab_size)
        try:
            request = _REQUEST_TYPES[protocol](body)
        except (ValueError, TypeError, OverflowError) as exc:  # Overflow: ints beyond i64/u64
            raise RecipeError(400, _body_error_message(exc), protocol) from exc
        echo = request.echo() if protocol is Protocol.RESPONSES else None
        namespace_map = None
        try:
            if protocol is Protocol.RESPONSES:
                namespace_map = request.namespace_tool_map(self._options)
            converted = request.convert(self._options)
        except dr.ConversionError as exc:
            converted = self._convert_forced_choice(body, protocol, extras.constraints)
            if converted is None:
                raise _conversion_error(exc, protocol) from exc
        options = extras.constraints
        constraint = effective_constraint(
            converted.inference_options.output_constraint, options, protocol
        )
        conversation = converted.conversation
        if options.extension is not None and options.extension.kind == "json":
            conversation = _with_response_format(conversation, options.extension)
        rendered = self._encoding.render_conversation(conversation)
        if rendered.image_sources:
            raise RecipeError(
                400,
                "Image inputs are not supported yet by this server (vision comes later).",
                protocol,
            )
        prompt_ids = self.tokenizer.encode_prompt(rendered)
        max_tokens = self._max_tokens(converted, len(prompt_ids), protocol)
        parsing = converted.parsing_options
        if extras.stop is not None:
            parsing.stop_sequences = extras.stop
        # No tools may be called: the marker token that opens tool markup is never sampled.
        banned = () if parsing.parse_tool_calls else (self.tokenizer.dsml_token_id,)
        rules = _OutputRules(
            banned, self._thinking_budget(extras.thinking, parsing, max_tokens, protocol)
        )
        prepared = PreparedRequest(
            protocol=protocol,
            model=str(body.get("model")),
            prompt_token_ids=prompt_ids,
            sampling_params=_sampling_params(converted, extras, max_tokens, rules, protocol),
            parsing_options=parsing,
            conversation_request=converted,
            stream=converted.stream,
            include_usage=extras.include_usage and converted.stream,
            thinking=parsing.thinking_initial_stage is not None,
            output_constraint=constraint,
            grammar=grammar_spec(constraint, conversation, parsing, options, protocol),
            echo=echo,
            namespace_tool_map=namespace_map,
            reasoning_sealer=(
                self._sealer
                if extras.include_encrypted_reasoning or not extras.thinking.is_shown
                else None
            ),
            prompt_cache_key=extras.prompt_cache_key,
            cache_salt=cache_salt,
            is_thinking_shown=extras.thinking.is_shown,
            traffic_class=traffic_class,
        )
        return with_sampling_fields(prepared, sampling_fields, protocol)

    def _thinking_budget(
        self,
        options: ThinkingOptions,
        parsing: dr.ParsingOptions,
        max_tokens: int,
        protocol: Protocol,
    ) -> ThinkingBudget | None:
        """The engine's budget for `thinking.budget_tokens` (None: none asked, or the output
        does not start in reasoning).

        Raises:
            RecipeError: 400 when the budget is not below the output limit (as Anthropic).
        """
        budget = options.budget_tokens
        if budget is None:
            return None
        if budget >= max_tokens:
            raise RecipeError(
                400,
                f"max_tokens must be greater than thinking.budget_tokens ({max_tokens} <= "
                f"{budget})",
                protocol,
                "thinking.budget_tokens",
            )
        if parsing.thinking_initial_stage not in _REASONING_STAGES:
            return None
        # A tool call also ends the reasoning (the model may go straight to one).
        ended_by = (self.tokenizer.dsml_token_id,) if parsing.parse_tool_calls else ()
        return ThinkingBudget(budget, self.tokenizer.thinking_end_token_id, ended_by)

    def _traffic_class(self, body: dict[str, Any], header: str | None, protocol: Protocol) -> str:
        """The request's KV cache TTL class (see `prepare`); 400 for an unknown one."""
        value = body.pop("traffic_class", None)
        source = "traffic_class"
        if value is None and header is not None:
            value, source = header, "X-Deepinfer-Traffic-Class"
        if value is None:
            return "agent" if body.get("tools") else "chat"
        classes = self.config.traffic_classes
        if not isinstance(value, str) or value not in classes:
            raise RecipeError(
                400, f"{source} must be one of {', '.join(classes)}", protocol, "traffic_class"
            )
        return value

    def _max_tokens(
        self, converted: dr.ConversationRequest, num_prompt_tokens: int, protocol: Protocol
    ) -> int:
        """The request's output limit. Without one (Chat, Responses; Messages requires it) the
        rest of the context, as vLLM does, not the package's per-mode defaults (8,192 / 65,536),
        lowered to `default_max_tokens` and `max_tokens_limit` when they are set.

        Raises:
            RecipeError: 400 when prompt + limit exceed the context.
        """
        context_len = self.config.context_len
        try:
            max_tokens = converted.resolve_max_tokens(num_prompt_tokens, context_len)
        except dr.ConversionError as exc:
            raise _conversion_error(exc, protocol) from exc
        if converted.inference_options.max_tokens is None:
            max_tokens = max(1, context_len - num_prompt_tokens)
            for bound in (self.config.default_max_tokens, self.config.max_tokens_limit):
                max_tokens = min(max_tokens, bound or max_tokens)
        return max_tokens

    def _convert_forced_choice(
        self, body: dict[str, Any], protocol: Protocol, options: ConstraintOptions
    ) -> dr.ConversationRequest | None:
        """A forced tool_choice the package refused because thinking is on, converted as `auto`
        (`relaxed_tool_choice`) with the call required by the grammar; None when the refusal
        was for anything else."""
        relaxed = relaxed_tool_choice(body, protocol)
        if relaxed is None:
            return None
        try:
            converted = _REQUEST_TYPES[protocol](relaxed).convert(self._options)
        except (ValueError, TypeError, OverflowError, dr.ConversionError):
            return None
        if converted.parsing_options.thinking_initial_stage is None:
            return None
        options.require_tool_call = True
        return converted


_BODY_ERROR_PREFIXES = ("invalid request body: ", "invalid JSON request: ")


def _body_error_message(exc: Exception) -> str:
    """The package's parse errors carry their prefix already; ours adds it to the others."""
    message = str(exc)
    if message.startswith(_BODY_ERROR_PREFIXES):
        return message
    return _BODY_ERROR_PREFIXES[0] + message


def _pop_cache_salt(body: dict[str, Any], protocol: Protocol) -> str | None:
    """`cache_salt`: requests share prefix-cache blocks only with requests of the same salt."""
    salt = body.pop("cache_salt", None)
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RecipeError(400, "cache_salt must be a non-empty string", protocol, "cache_salt")
    return salt


def _conversion_error(exc: dr.ConversionError, protocol: Protocol) -> RecipeError:
    try:
        message = json.loads(exc.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = str(exc)
    return RecipeError(exc.status_code, message, protocol)


def _with_response_format(
    conversation: dr.Conversation, constraint: OutputConstraint
) -> dr.Conversation:
    """`conversation` asking for a JSON answer (the template's Response Format section), for
    JSON constraints that do not come from the package (grammar extensions, Messages); an
    empty schema (json_object) or `{}` renders as json_object."""
    schema = json.loads(constraint.schema) if constraint.schema else {}
    return dr.Conversation(
        conversation.messages,
        thinking_mode=conversation.thinking_mode,
        tools=conversation.tools,
        tool_choice=conversation.tool_choice,
        reasoning_effort=conversation.reasoning_effort,
        response_format="json_object" if schema == {} else "text",
        response_schema=None if schema == {} else schema,
    )


def _sampling_params(
    converted: dr.ConversationRequest,
    extras: _Extras,
    max_tokens: int,
    rules: _OutputRules,
    protocol: Protocol,
) -> SamplingParams:
    options = converted.inference_options
    try:
        return SamplingParams(
            temperature=_unwiden(options.temperature, 1.0),
            top_p=_unwiden(options.top_p, 1.0),
            top_k=extras.top_k,
            presence_penalty=extras.presence_penalty,
            frequency_penalty=extras.frequency_penalty,
            logit_bias=extras.logit_bias or {},
            n=extras.n,
            logprobs=options.logprobs,
            top_logprobs=(options.top_logprobs or 0) if options.logprobs else 0,
            max_tokens=max_tokens,
            seed=options.seed,
            banned_token_ids=rules.banned_token_ids,
            thinking_budget=rules.thinking_budget,
            affinity_key=extras.prompt_cache_key,
        )
    except (TypeError, ValueError) as exc:
        raise RecipeError(400, str(exc), protocol) from exc


def _unwiden(value: float | None, default: float) -> float:
    """The package stores f32 values (`0.3` -> 0.30000001192092896); give back the short one."""
    if value is None:
        return default
    return float(str(np.float32(value)))


# ---------------------------------------------------------------- per-protocol preprocessing


def _refuse_unsupported(body: dict[str, Any], protocol: Protocol, rules: dict) -> None:
    """400 for a field whose value asks for behaviour this server does not have.

    rules: field → (values that are fine, why other values are refused). Absent or None is fine.
    """
    for name, (fine, why) in rules.items():
        value = body.get(name)
        if value is not None and value not in fine:
            raise RecipeError(
                400, f"'{name}': {json.dumps(value)} is not supported: {why}", protocol, name
            )


_CHAT_UNSUPPORTED = {
    "store": ((False,), "this server does not store completions"),
    "service_tier": (("auto", "default"), "this server has one service tier"),
}
_RESPONSES_UNSUPPORTED = {
    "truncation": (("disabled",), "over-long inputs are rejected, not truncated"),
    "metadata": (({},), "this server does not store responses"),
}
ENCRYPTED_REASONING = "reasoning.encrypted_content"
_REASONING_SUMMARIES = (None, "auto", "concise", "detailed")
_CONTEXT_EDITS = ("clear_thinking_20251015",)


def _preprocess_chat(body: dict[str, Any], protocol: Protocol) -> _Extras:
    _refuse_unsupported(body, protocol, _CHAT_UNSUPPORTED)
    extras = _Extras(constraints=pop_chat_extensions(body, protocol))
    _apply_chat_template_kwargs(body, protocol)
    extras.thinking = _pop_thinking_options(body, protocol)
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "developer":
                message["role"] = "system"
    if body.get("max_completion_tokens") is not None:
        body["max_tokens"] = body["max_completion_tokens"]
    body.pop("max_completion_tokens", None)
    if body.get("stop") is not None:
        _parse_stop(body["stop"], protocol)  # OpenAI's limit of 4, as on Responses (issue 13)
    n = body.pop("n", None)
    if n is not None:
        if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
            raise RecipeError(400, f"n must be an integer in [1, {MAX_CHOICES}]", protocol, "n")
        extras.n = n
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise RecipeError(400, f"{name} must be a number", protocol, name)
            setattr(extras, name, float(value))  # the range is checked by the package
    options = body.get("stream_options")
    if isinstance(options, dict):
        extras.include_usage = options.get("include_usage") is True
    return extras


def _preprocess_responses(body: dict[str, Any], protocol: Protocol) -> _Extras:
    for name, refused in (("previous_response_id", None), ("background", False)):
        if body.get(name, refused) not in (refused, None):
            raise RecipeError(
                400,
                f"'{name}' is not supported: this server does not store responses.",
                protocol,
                name,
            )
    if body.get("store") is True:
        raise RecipeError(
            400,
            "'store': true is not supported: this server does not store responses; "
            "send 'store': false.",
            protocol,
            "store",
        )
    _refuse_unsupported(body, protocol, _RESPONSES_UNSUPPORTED)
    extras = _Extras(constraints=pop_responses_options(body, protocol))
    extras.thinking = _pop_thinking_options(body, protocol)
    _apply_thinking_extension(body, protocol)
    stop = body.pop("stop", None)
    if stop is not None:
        extras.stop = _parse_stop(stop, protocol)
    extras.include_encrypted_reasoning = _pop_include(body, protocol)
    extras.prompt_cache_key = _pop_prompt_cache_key(body, protocol)
    _check_client_metadata(body.pop("client_metadata", None), protocol)
    reasoning = body.get("reasoning")
    summary = reasoning.get("summary") if isinstance(reasoning, dict) else None
    if summary not in _REASONING_SUMMARIES:
        # NOTE: summaries are not generated (`summary` stays []): the whole reasoning streams
        # as `reasoning_text`. The setting is checked and echoed, as OpenAI does.
        raise RecipeError(
            400,
            f"reasoning.summary: expected one of auto, concise, detailed, got {summary!r}",
            protocol,
            "reasoning",
        )
    return extras


def _apply_thinking_extension(body: dict[str, Any], protocol: Protocol) -> None:
    """Responses `thinking: {"type": "enabled" | "adaptive" | "disabled"}`, the extension Chat
    and Messages take, as `reasoning.effort` (the package reads only that): `disabled` turns
    thinking off whatever the effort says (as in Chat); `enabled` / `adaptive` keep it on (the
    default) and override an effort of `none`."""
    thinking = body.pop("thinking", None)
    if thinking is None:
        return
    kind = thinking["type"]  # checked by `_pop_thinking_options`
    reasoning = body.get("reasoning")
    reasoning = dict(reasoning) if isinstance(reasoning, dict) else {}
    effort = reasoning.get("effort")
    if kind == "disabled":
        reasoning["effort"] = "none"
    elif effort == "none":
        reasoning["effort"] = "high"  # the effort of an unspecified one
    body["reasoning"] = reasoning


_THINKING_TYPES = ("enabled", "adaptive", "disabled")
_THINKING_DISPLAYS = {"summarized": True, "omitted": False}  # display -> is the text shown
_REASONING_STAGES = (
    dr.ThinkingInitialStage.ReasoningStart,
    dr.ThinkingInitialStage.ReasoningContinuation,
)


def _pop_thinking_options(
    body: dict[str, Any], protocol: Protocol, *, has_display: bool = False
) -> ThinkingOptions:
    """Check the `thinking` object (`{"type": "enabled" | "adaptive" | "disabled"}`, plus
    `budget_tokens` (an int >= 1, with `enabled` only) and, where has_display (Messages),
    `display` ("summarized" | "omitted", not with `disabled`)) and take what the package does
    not read out of it, leaving `{"type": ...}`.

    NOTE: Anthropic requires budget_tokens >= 1024; any budget >= 1 is accepted here (the
    engine ends the reasoning at whatever count), so every budget Anthropic takes works.
    """
    thinking = body.get("thinking")
    if thinking is None:
        return ThinkingOptions()
    allowed = {"type", "budget_tokens", *(("display",) if has_display else ())}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in _THINKING_TYPES or set(thinking) - allowed:
        keys = ", ".join(f'"{k}"' for k in sorted(allowed - {"type"}))
        raise RecipeError(
            400,
            f'thinking: must be {{"type": "enabled" | "adaptive" | "disabled"}} (optional keys: '
            f"{keys})",
            protocol,
            "thinking",
        )
    budget = thinking.get("budget_tokens")
    if budget is not None and (kind != "enabled" or not _is_int(budget) or budget < 1):
        raise RecipeError(
            400,
            'thinking.budget_tokens: must be an integer >= 1, with "type": "enabled"',
            protocol,
            "thinking.budget_tokens",
        )
    display = thinking.get("display")
    if display is not None and (kind == "disabled" or display not in _THINKING_DISPLAYS):
        raise RecipeError(
            400,
            'thinking.display: must be "summarized" or "omitted" (not with "disabled")',
            protocol,
            "thinking.display",
        )
    body["thinking"] = {"type": kind}
    return ThinkingOptions(budget, _THINKING_DISPLAYS[display or "summarized"])


_TEMPLATE_KWARGS = {"thinking": bool, "enable_thinking": bool, "reasoning_effort": str}


def _apply_chat_template_kwargs(body: dict[str, Any], protocol: Protocol) -> None:
    """vLLM's `chat_template_kwargs` on Chat: `thinking` / `enable_thinking` (bool) become the
    `thinking` object, `reasoning_effort` (str) the field; other keys are 400 (this server has
    one template and no other switches). A value that contradicts the body's own field is 400.
    """
    kwargs = body.pop("chat_template_kwargs", None)
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise RecipeError(
            400, "chat_template_kwargs must be an object", protocol, "chat_template_kwargs"
        )
    for name, value in kwargs.items():
        if not isinstance(value, _TEMPLATE_KWARGS.get(name, ())):
            raise RecipeError(
                400,
                f"chat_template_kwargs.{name}: not supported (only thinking / enable_thinking "
                "(bool) and reasoning_effort (str))",
                protocol,
                f"chat_template_kwargs.{name}",
            )
    for name, value in kwargs.items():
        field_name = "reasoning_effort" if name == "reasoning_effort" else "thinking"
        _set_or_check(body, field_name, value, f"chat_template_kwargs.{name}", protocol)


def _set_or_check(
    body: dict[str, Any], name: str, value: bool | str, source: str, protocol: Protocol
) -> None:
    """Set body[name] from a template kwarg (`thinking`: a bool, as the `thinking` object), or
    400 when the body already says otherwise."""
    if name == "thinking":
        value = {"type": "enabled" if value else "disabled"}
    current = body.get(name)
    if current is None:
        body[name] = value
        return
    if name == "thinking":
        kind = current.get("type") if isinstance(current, dict) else None
        agrees = (kind == "disabled") is (value["type"] == "disabled")
    else:
        agrees = current == value
    if not agrees:
        raise RecipeError(400, f"{source} contradicts '{name}' in the request", protocol, source)


def _pop_include(body: dict[str, Any], protocol: Protocol) -> bool:
    """Whether `include` asks for sealed reasoning (the one extra output this server has)."""
    include = body.pop("include", None)
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
        raise RecipeError(400, "include: must be a list of strings", protocol, "include")
    for item in include:
        if item != ENCRYPTED_REASONING:
            raise RecipeError(
                400,
                f"'include': {json.dumps(item)} is not supported: the only additional output "
                f"data is {json.dumps(ENCRYPTED_REASONING)}",
                protocol,
                "include",
            )
    return bool(include)


def _pop_prompt_cache_key(body: dict[str, Any], protocol: Protocol) -> str | None:
    key = body.pop("prompt_cache_key", None)
    if key is not None and not isinstance(key, str):
        raise RecipeError(400, "prompt_cache_key: must be a string", protocol, "prompt_cache_key")
    return key


def _check_client_metadata(metadata: Any, protocol: Protocol) -> None:
    """`client_metadata` (Codex's per-turn ids): an object of strings. It describes the
    client, not the generation; with `store: false` nothing keeps it."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(
        isinstance(value, str) for value in metadata.values()
    ):
        raise RecipeError(
            400, "client_metadata: must be an object of strings", protocol, "client_metadata"
        )


def _open_sealed_reasoning(
    body: dict[str, Any], sealer: ReasoningSealer, protocol: Protocol
) -> None:
    """Reasoning items of `input` with an `encrypted_content` get their reasoning back.

    The opened text replaces the item's `content` (as one `reasoning_text` part), so the
    package replays it where the recipe renders history (`recipe.md` §5.3).

    Raises:
        RecipeError: 400 for a token this server did not seal (forged, altered, or sealed
            under another key: a restart without `--reasoning-key-file`).
    """
    items = body.get("input")
    if not isinstance(items, list):
        return
    for index, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type") != "reasoning":
            continue
        token = item.pop("encrypted_content", None)
        if token is None:
            continue
        param = f"input[{index}].encrypted_content"
        try:
            if not isinstance(token, str):
                raise SealError("must be a string")
            text = sealer.unseal(token)
        except SealError as exc:
            raise RecipeError(
                400,
                f"{param}: the encrypted content could not be verified ({exc}); it opens only "
                "on the server that sealed it, with the same --reasoning-key-file",
                protocol,
                param,
            ) from exc
        item["content"] = [{"type": "reasoning_text", "text": text}]


def _open_sealed_thinking(body: dict[str, Any], sealer: ReasoningSealer) -> None:
    """Thinking blocks returned with `display: "omitted"` get their reasoning back.

    Such a block comes back with empty `thinking` and the signature this server gave it, which
    seals the reasoning; the opened text fills the block, so the prompt renders the reasoning
    as it was generated (kept in history when tools are declared, `recipe.md` §2). A signature
    that does not open (a shown block's, or another server's) leaves the block as it is: the
    reasoning was already in its text, or is lost as with any client that drops it.
    """
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        content = message.get("content")
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, dict) or block.get("type") != "thinking":
                continue
            signature = block.get("signature")
            if block.get("thinking") or not isinstance(signature, str):
                continue
            try:
                block["thinking"] = sealer.unseal(signature)
            except SealError:
                continue


def _preprocess_messages(body: dict[str, Any], protocol: Protocol) -> _Extras:
    if body.get("max_tokens") is None:
        raise RecipeError(400, "max_tokens: Field required", protocol, "max_tokens")
    extras = _Extras(constraints=messages_options(body, protocol))
    _check_context_management(body.pop("context_management", None), protocol)
    if body.get("thinking") is None:  # Anthropic: no `thinking`, no thinking
        body["thinking"] = {"type": "disabled"}
    extras.thinking = _pop_thinking_options(body, protocol, has_display=True)
    top_k = body.pop("top_k", None)
    if top_k is not None:
        if not _is_int(top_k) or top_k < 0:
            raise RecipeError(400, "top_k: must be a non-negative integer", protocol, "top_k")
        extras.top_k = top_k
    return extras


def _check_context_management(value: Any, protocol: Protocol) -> None:
    """Messages `context_management` (Claude Code): `clear_thinking` edits are what the
    recipe does anyway (history renders the reasoning DeepSeek's template keeps, whatever the
    request keeps); other edits (clearing tool results) are refused."""
    if value is None:
        return
    edits = value.get("edits") if isinstance(value, dict) else None
    if not isinstance(edits, list) or not all(isinstance(edit, dict) for edit in edits):
        raise RecipeError(400, "context_management.edits: must be a list of objects", protocol)
    for edit in edits:
        if edit.get("type") not in _CONTEXT_EDITS:
            raise RecipeError(
                400,
                f"context_management: edit {json.dumps(edit.get('type'))} is not supported; "
                f"supported: {', '.join(_CONTEXT_EDITS)}",
                protocol,
            )


def _parse_logit_bias(bias: Any, protocol: Protocol, vocab_size: int) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise RecipeError(400, "logit_bias must be an object", protocol, "logit_bias")
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if token_id < 0 or not isinstance(value, int | float) or isinstance(value, bool):
            raise RecipeError(
                400, f"logit_bias: invalid entry {key!r}: {value!r}", protocol, "logit_bias"
            )
        if token_id >= vocab_size:
            raise RecipeError(
                400,
                f"logit_bias: token id {token_id} is outside the vocabulary [0, {vocab_size})",
                protocol,
                "logit_bias",
            )
        parsed[token_id] = float(value)
    return parsed


def _parse_stop(stop: Any, protocol: Protocol) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RecipeError(
            400,
            f"stop must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} "
            "non-empty strings",
            protocol,
            "stop",
        )
    return stops


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_PREPROCESSORS: dict[Protocol, Callable[[dict[str, Any], Protocol], _Extras]] = {
    Protocol.CHAT: _preprocess_chat,
    Protocol.RESPONSES: _preprocess_responses,
    Protocol.MESSAGES: _preprocess_messages,
}
_REQUEST_TYPES: dict[Protocol, Callable[[Any], Any]] = {
    Protocol.CHAT: dr.ChatCompletionRequest,
    Protocol.RESPONSES: dr.ResponsesRequest,
    Protocol.MESSAGES: dr.MessagesRequest,
}
