"""Protocol-independent routes: what the server is (`/`), health, model list,
tokenize/detokenize, metrics."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from importlib import metadata
from typing import Annotated, Any, Literal

import deepseek_recipe as dr
from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from engine.client import EngineClient
from recipe.convert import Recipe
from recipe.errors import Protocol
from recipe.tokenizer import check_text
from server.config import ServerConfig
from server.dependencies import (
    ServerState,
    get_config,
    get_engine,
    get_state,
    get_tokenizer,
    resolve_model_name,
)
from server.errors import APIError, ErrorKind
from server.metrics import CONTENT_TYPE
from server.openapi import error_responses

router = APIRouter()
_HEALTH_ERRORS: dict[int | str, dict] = {503: {"description": "Not running, or draining"}}
_ERRORS = error_responses(anthropic=False, generation=False)

_CREATED = int(time.time())  # "created" of the model list: the process start
_PACKAGE = "deepinfer-server"
_ROUTES = (
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "GET /v1/models",
    "POST /tokenize",
    "POST /detokenize",
    "GET /health",
    "GET /metrics",
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Strict):
    """vLLM's completion-style `/tokenize` body.

    `prompt` is plain text, encoded as a prompt's text is: special spellings (`<｜User｜>`,
    `</think>`, ...) stay ordinary tokens. add_special_tokens: BOS first (as every rendered
    prompt starts); false: the text's tokens only.
    """

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenizeRequest(_Strict):
    """vLLM's chat-style `/tokenize` body: the ids of the prompt a Chat request with these
    `messages` / `tools` renders (`usage.prompt_tokens` of that request).

    add_generation_prompt: end with the assistant header (`<｜Assistant｜><think>` or
    `</think>`), as a request does; false: end after the last message.
    chat_template_kwargs: `thinking` / `enable_thinking` (bool) and `reasoning_effort` only.
    add_special_tokens: false only (the rendered prompt has its BOS); continue_final_message:
    false only (send an assistant message with `prefix: true` instead).
    """

    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: Literal[False] = False
    add_special_tokens: Literal[False] = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


@router.head("/", include_in_schema=False)  # one OpenAPI operation: GET's
@router.get("/")
async def root(config: Annotated[ServerConfig, Depends(get_config)]) -> dict:
    """What this server is (clients such as Claude Code probe `HEAD /` at start)."""
    try:
        version = metadata.version(_PACKAGE)
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "name": _PACKAGE,
        "version": version,
        "models": list(config.served_model_names),
        "routes": list(_ROUTES),
        "docs": "/docs",
    }


class HealthResponse(BaseModel):
    status: str  # "ok"; a draining server answers 503 {"status": "draining"} (server.drain)


@router.get("/health", responses=_HEALTH_ERRORS)
async def health(state: Annotated[ServerState, Depends(get_state)]) -> HealthResponse:
    if state.engine is None or not state.engine.is_running:
        raise APIError(ErrorKind.UNAVAILABLE, "the engine is not running")
    return HealthResponse(status="ok")


def _model_card(name: str, max_model_len: int) -> dict:
    # One object that both SDKs parse: OpenAI's Model and Anthropic's ModelInfo.
    return {
        "id": name,
        "object": "model",
        "created": _CREATED,
        "owned_by": "deepinfer",
        "type": "model",
        "display_name": name,
        "created_at": datetime.fromtimestamp(_CREATED, UTC).isoformat().replace("+00:00", "Z"),
        "max_model_len": max_model_len,
    }


@router.get("/v1/models", responses=_ERRORS)
async def list_models(
    config: Annotated[ServerConfig, Depends(get_config)],
    engine: Annotated[EngineClient, Depends(get_engine)],
) -> dict:
    """OpenAI's list shape, with Anthropic's paging fields so its SDK parses it too."""
    max_model_len = engine.info.max_model_len
    names = config.served_model_names
    return {
        "object": "list",
        "data": [_model_card(name, max_model_len) for name in names],
        "has_more": False,
        "first_id": names[0],
        "last_id": names[-1],
    }


@router.get("/v1/models/{model_id:path}", responses=_ERRORS)
async def retrieve_model(
    model_id: str,
    config: Annotated[ServerConfig, Depends(get_config)],
    engine: Annotated[EngineClient, Depends(get_engine)],
) -> dict:
    name = resolve_model_name(config, model_id)
    return _model_card(name, engine.info.max_model_len)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(
    body: TokenizeRequest | ChatTokenizeRequest,
    state: Annotated[ServerState, Depends(get_state)],
    engine: Annotated[EngineClient, Depends(get_engine)],
    tokenizer: Annotated[Tokenizer, Depends(get_tokenizer)],
) -> Response:
    model = resolve_model_name(state.config, body.model)
    max_model_len = engine.info.max_model_len

    def answer() -> bytes:
        ids, strs = _tokenize(state.recipe, tokenizer, model, body)
        response = TokenizeResponse(
            count=len(ids),
            max_model_len=max_model_len,
            tokens=ids,
            token_strs=strs if body.return_token_strs else None,
        )
        return response.model_dump_json().encode()

    # Encoding (and serialising) a prompt of megabytes takes seconds: off the event loop.
    return Response(await asyncio.to_thread(answer), media_type="application/json")


def _tokenize(
    recipe: Recipe | None,
    tokenizer: Tokenizer,
    model: str,
    body: TokenizeRequest | ChatTokenizeRequest,
) -> tuple[list[int], list[str] | None]:
    """The ids (and token strings when asked) `/tokenize` answers with."""
    if isinstance(body, ChatTokenizeRequest):
        if recipe is None:
            raise APIError(ErrorKind.UNAVAILABLE, "this model has no chat template")
        ids = _chat_prompt_ids(recipe, model, body)
        return ids, [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    if recipe is not None:
        try:
            return recipe.tokenizer.encode_text(body.prompt, body.add_special_tokens)
        except ValueError as exc:
            raise APIError(ErrorKind.INVALID_REQUEST, str(exc), param="prompt") from exc
    # a model without the chat template (`tiny`): its own tokenizer's rules
    try:
        check_text(body.prompt)
    except ValueError as exc:
        raise APIError(ErrorKind.INVALID_REQUEST, str(exc), param="prompt") from exc
    # `encode_batch` releases the GIL (`encode` does not), so the event loop runs meanwhile
    [encoding] = tokenizer.encode_batch([body.prompt], add_special_tokens=body.add_special_tokens)
    return list(encoding.ids), list(encoding.tokens)


def _chat_prompt_ids(recipe: Recipe, model: str, body: ChatTokenizeRequest) -> list[int]:
    """The prompt ids of the Chat request these fields make (`RecipeError` 400 as it would,
    `chat_template_kwargs` included)."""
    chat: dict[str, Any] = {"model": model, "messages": body.messages, "max_tokens": 1}
    if body.tools is not None:
        chat["tools"] = body.tools
    if body.chat_template_kwargs is not None:
        chat["chat_template_kwargs"] = body.chat_template_kwargs
    ids = recipe.prepare(Protocol.CHAT, chat).prompt_token_ids
    if not body.add_generation_prompt:
        ids = ids[: -len(_generation_header(recipe, ids))]
    return ids


def _generation_header(recipe: Recipe, ids: list[int]) -> list[int]:
    """The assistant header a rendered prompt ends with: `<｜Assistant｜>` then `<think>` or
    `</think>`."""
    special = recipe.tokenizer.special_ids
    tokens = recipe.tokenizer.special_tokens
    assistant = special[tokens.token(dr.SpecialToken.Assistant)]
    thinking = {
        special[tokens.token(dr.SpecialToken.ThinkingStart)],
        special[tokens.token(dr.SpecialToken.ThinkingEnd)],
    }
    if len(ids) < 2 or ids[-2] != assistant or ids[-1] not in thinking:
        raise APIError(ErrorKind.INTERNAL, "the rendered prompt has no generation header")
    return ids[-2:]


@router.post("/detokenize", responses=_ERRORS)
async def detokenize(
    body: DetokenizeRequest,
    config: Annotated[ServerConfig, Depends(get_config)],
    tokenizer: Annotated[Tokenizer, Depends(get_tokenizer)],
) -> DetokenizeResponse:
    """Text of `tokens`, special tokens spelled out: the inverse of `/tokenize` (whose plain
    text never holds special ids, so a round trip gives the text back)."""
    resolve_model_name(config, body.model)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab_size:
            raise APIError(
                ErrorKind.INVALID_REQUEST,
                f"token id {token} is out of range [0, {vocab_size})",
                param=f"tokens[{i}]",
            )
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


@router.get("/metrics")
async def metrics(state: Annotated[ServerState, Depends(get_state)]) -> Response:
    return Response(state.metrics.render(state.engine), media_type=CONTENT_TYPE)


@router.get("/internal/kv/slot/{slot_id}", include_in_schema=False)
async def resume_slot(
    slot_id: int,
    generation: int,
    engine: Annotated[EngineClient, Depends(get_engine)],
) -> Response:
    """A resume slot's bytes for another server sharing the cache directory (`cache.md` §3.4;
    the puller checks the length and CRC its pointer file promised); 404 when this server
    holds no slot of that id and generation."""
    payload = engine.resume_slot_payload(slot_id, generation)
    if payload is None:
        raise APIError(ErrorKind.NOT_FOUND, f"no resume slot {slot_id} of generation {generation}")
    return Response(payload, media_type="application/octet-stream")
