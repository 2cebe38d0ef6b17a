"""The three protocol routes: Chat Completions, Responses, Messages (+ Messages count_tokens).

Each route is thin: parse JSON → `Recipe.prepare` (validation, prompt ids, sampling params) →
admission → `EngineClient.generate` → `ResponseBridge` (protocol events or one body). Leaving a
stream early (client gone) closes the engine iterator, which aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from engine.async_engine import RequestRejectedError
from engine.client import EngineClient
from engine.structured import CompiledConstraint, GrammarCompilerBusyError, GrammarError
from recipe.bridge import ResponseBridge, StreamEvent
from recipe.convert import PreparedRequest, Recipe
from recipe.errors import Protocol, RecipeError
from server.admission import AdmissionController
from server.dependencies import (
    ServerState,
    get_admission,
    get_engine,
    get_metrics,
    get_state,
    resolve_model_name,
    state_of,
)
from server.disconnect import run_until_disconnect
from server.errors import APIError, ErrorKind
from server.metrics import ServerMetrics
from server.openapi import (
    CHAT_REQUEST,
    COUNT_TOKENS_REQUEST,
    MESSAGES_REQUEST,
    RESPONSES_REQUEST,
    error_responses,
    request_body,
)
from server.sse import anthropic_error_event, data_stream, event_stream, responses_error_event

router = APIRouter()

_ID_PREFIX = {Protocol.CHAT: "chatcmpl-", Protocol.RESPONSES: "resp_", Protocol.MESSAGES: "msg_"}


async def get_recipe(state: Annotated[ServerState, Depends(get_state)]) -> Recipe:
    if state.recipe is None:
        raise APIError(ErrorKind.UNAVAILABLE, "the protocol layer is not loaded")
    return state.recipe


Engine = Annotated[EngineClient, Depends(get_engine)]
RecipeDep = Annotated[Recipe, Depends(get_recipe)]
Admission = Annotated[AdmissionController, Depends(get_admission)]
Metrics = Annotated[ServerMetrics, Depends(get_metrics)]


OFF_LOOP_BYTES = 64 * 1024
"""Bodies larger than this are parsed, rendered and tokenized in a worker thread, so the event
loop (health checks, other streams) keeps running meanwhile."""


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(ErrorKind.INVALID_REQUEST, f"malformed JSON body: {exc}") from exc


async def _prepare(
    request: Request, recipe: Recipe, protocol: Protocol, defaults: dict[str, Any] | None = None
) -> PreparedRequest:
    """Parse the body (`defaults` fill missing fields) and `Recipe.prepare` it; an unknown
    `model` is a 404. Off the event loop for bodies over `OFF_LOOP_BYTES`."""
    raw = await request.body()

    def prepare() -> PreparedRequest:
        body = _parse_json(raw)
        if isinstance(body, dict) and defaults:
            body = {**defaults, **body}
        _check_model(request, body)
        return recipe.prepare(protocol, body, request.headers.get("x-deepinfer-traffic-class"))

    return await asyncio.to_thread(prepare) if len(raw) > OFF_LOOP_BYTES else prepare()


async def _compile_constraint(
    prepared: PreparedRequest, state: ServerState
) -> CompiledConstraint | None:
    """The compiled grammar of the request, or None. A grammar that fails or times out is a 400
    in the protocol's envelope; a compiler busy with other compilations is a 429 / 529."""
    if prepared.grammar is None:
        return None
    if state.grammar_compiler is None:
        raise APIError(ErrorKind.UNAVAILABLE, "the grammar compiler is not loaded")
    try:
        return await state.grammar_compiler.constraint_async(
            prepared.grammar, state.config.grammar_compile_timeout_s
        )
    except GrammarCompilerBusyError as exc:
        raise APIError(ErrorKind.OVERLOADED, str(exc)) from exc
    except GrammarError as exc:
        raise RecipeError(400, str(exc), prepared.protocol) from exc


def _check_model(request: Request, body: Any) -> None:
    """404 `model_not_found` for a model this server does not serve (before the package's 400
    for names it does not know)."""
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        resolve_model_name(state_of(request).config, body["model"])


class _Call:
    """One protocol request in flight: its prepared form, grammar, bridge, engine and metrics."""

    def __init__(
        self,
        prepared: PreparedRequest,
        constraint: CompiledConstraint | None,
        recipe: Recipe,
        engine: EngineClient,
        metrics: Metrics,
    ) -> None:
        self.prepared = prepared
        self.constraint = constraint
        self.engine = engine
        self.metrics = metrics
        self.request_id = _ID_PREFIX[prepared.protocol] + uuid.uuid4().hex
        self.tokenizer = recipe.tokenizer
        self.bridge: ResponseBridge | None = None  # made at the first delta (see `events`)
        self.finish_reason = "abort"

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Protocol events until the bridge closes; aborts choices ended by a stop sequence."""
        stream = self.engine.generate(
            self.prepared.prompt_token_ids,
            self.prepared.sampling_params,
            self.request_id,
            self.constraint,
            cache_salt=self.prepared.cache_salt,
            traffic_class=self.prepared.traffic_class,
        )
        try:
            async for delta in stream:
                if self.bridge is None:  # prompt usage carries the cached tokens of admission
                    self.bridge = ResponseBridge(
                        self.prepared,
                        self.tokenizer,
                        self.request_id,
                        num_cached_tokens=delta.num_cached_tokens,
                    )
                    for event in self.bridge.start():
                        yield event
                if delta.queue_time_s is not None:
                    self.metrics.on_scheduled(self.request_id, delta.queue_time_s)
                self.metrics.on_tokens(self.request_id, len(delta.token_ids))
                step = self.bridge.push(delta)
                if step.abort:
                    self.engine.abort(delta.request_id)
                for event in step.events:
                    yield event
                if delta.finish_reason is not None:
                    self.finish_reason = str(delta.finish_reason)
                if self.bridge.is_finished:
                    break
        finally:
            await stream.aclose()
            self.metrics.on_finish(
                self.request_id, self.prepared.num_prompt_tokens, self.finish_reason
            )

    async def collect(self) -> dict[str, Any]:
        async for _ in self.events():
            pass
        assert self.bridge is not None  # the engine always sends a final delta
        return self.bridge.response()


async def _serve(
    protocol: Protocol,
    request: Request,
    recipe: Recipe,
    engine: EngineClient,
    admission: AdmissionController,
    metrics: ServerMetrics,
):
    prepared = await _prepare(request, recipe, protocol)
    constraint = await _compile_constraint(prepared, state_of(request))
    try:
        engine.check_request(prepared.prompt_token_ids, prepared.sampling_params, constraint)
    except RequestRejectedError as exc:
        raise RecipeError(400, str(exc), prepared.protocol) from exc
    call = _Call(prepared, constraint, recipe, engine, metrics)
    metrics.on_request_start(call.request_id)
    if not prepared.stream:
        try:
            with admission.admit():
                return JSONResponse(await run_until_disconnect(request, call.collect()))
        except BaseException:
            metrics.on_finish(call.request_id, prepared.num_prompt_tokens, "abort")
            raise
    try:
        slot = admission.acquire()
    except BaseException:
        metrics.on_finish(call.request_id, prepared.num_prompt_tokens, "abort")
        raise

    if protocol is Protocol.CHAT:
        return data_stream(_data_only(slot, call.events()), send_done=False)
    return event_stream(_named(slot, call.events()), error_event=_error_event(protocol))


async def _data_only(
    slot: AbstractContextManager, events: AsyncIterator[StreamEvent]
) -> AsyncIterator[Any]:
    """Chat's payloads, holding the admission slot until the stream ends."""
    with slot:  # NOTE: released after the engine stream is closed (the request aborted)
        try:
            async for event in events:
                yield event.data
        finally:
            await events.aclose()


async def _named(
    slot: AbstractContextManager, events: AsyncIterator[StreamEvent]
) -> AsyncIterator[tuple[str, Any]]:
    """(name, payload) of each event, holding the admission slot until the stream ends."""
    with slot:  # NOTE: released after the engine stream is closed (the request aborted)
        try:
            async for event in events:
                yield (event.event or "message", event.data)
        finally:
            await events.aclose()


def _error_event(protocol: Protocol):
    return anthropic_error_event if protocol is Protocol.MESSAGES else responses_error_event


@router.post(
    "/v1/chat/completions",
    openapi_extra=request_body(CHAT_REQUEST),
    responses=error_responses(False),
)
async def chat_completions(
    request: Request, recipe: RecipeDep, engine: Engine, admission: Admission, metrics: Metrics
):
    return await _serve(Protocol.CHAT, request, recipe, engine, admission, metrics)


@router.post(
    "/v1/responses",
    openapi_extra=request_body(RESPONSES_REQUEST),
    responses=error_responses(False),
)
async def responses(
    request: Request, recipe: RecipeDep, engine: Engine, admission: Admission, metrics: Metrics
):
    return await _serve(Protocol.RESPONSES, request, recipe, engine, admission, metrics)


@router.post(
    "/v1/messages",
    openapi_extra=request_body(MESSAGES_REQUEST),
    responses=error_responses(True),
)
async def messages(
    request: Request, recipe: RecipeDep, engine: Engine, admission: Admission, metrics: Metrics
):
    return await _serve(Protocol.MESSAGES, request, recipe, engine, admission, metrics)


@router.post(
    "/v1/messages/count_tokens",
    openapi_extra=request_body(COUNT_TOKENS_REQUEST),
    responses=error_responses(True, generation=False),
)
async def count_tokens(request: Request, recipe: RecipeDep) -> dict[str, int]:
    prepared = await _prepare(request, recipe, Protocol.MESSAGES, defaults={"max_tokens": 1})
    return {"input_tokens": prepared.num_prompt_tokens}


def recipe_error_response(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RecipeError)
    return JSONResponse(exc.body(), status_code=exc.status_code)
