"""Protocol-independent routes: health, model list, tokenize/detokenize, metrics."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from engine.async_engine import AsyncEngine
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

router = APIRouter()

_CREATED = int(time.time())  # "created" of the model list: the process start


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Strict):
    """vLLM's completion-style `/tokenize` body."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
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


@router.get("/health")
async def health(state: Annotated[ServerState, Depends(get_state)]) -> Response:
    if state.engine is None or not state.engine.is_running:
        raise APIError(ErrorKind.UNAVAILABLE, "the engine is not running")
    return Response(status_code=200)


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


@router.get("/v1/models")
async def list_models(
    config: Annotated[ServerConfig, Depends(get_config)],
    engine: Annotated[AsyncEngine, Depends(get_engine)],
) -> dict:
    """OpenAI's list shape, with Anthropic's paging fields so its SDK parses it too."""
    max_model_len = engine.core.scheduler.config.max_model_len
    names = config.served_model_names
    return {
        "object": "list",
        "data": [_model_card(name, max_model_len) for name in names],
        "has_more": False,
        "first_id": names[0],
        "last_id": names[-1],
    }


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(
    model_id: str,
    config: Annotated[ServerConfig, Depends(get_config)],
    engine: Annotated[AsyncEngine, Depends(get_engine)],
) -> dict:
    name = resolve_model_name(config, model_id)
    return _model_card(name, engine.core.scheduler.config.max_model_len)


@router.post("/tokenize")
async def tokenize(
    body: TokenizeRequest,
    config: Annotated[ServerConfig, Depends(get_config)],
    engine: Annotated[AsyncEngine, Depends(get_engine)],
    tokenizer: Annotated[Tokenizer, Depends(get_tokenizer)],
) -> TokenizeResponse:
    resolve_model_name(config, body.model)
    encoding = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(
        count=len(encoding.ids),
        max_model_len=engine.core.scheduler.config.max_model_len,
        tokens=list(encoding.ids),
        token_strs=list(encoding.tokens) if body.return_token_strs else None,
    )


@router.post("/detokenize")
async def detokenize(
    body: DetokenizeRequest,
    config: Annotated[ServerConfig, Depends(get_config)],
    tokenizer: Annotated[Tokenizer, Depends(get_tokenizer)],
) -> DetokenizeResponse:
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
