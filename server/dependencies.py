"""FastAPI dependencies: how routes reach the engine, tokenizer, config, metrics and admission.

Everything lives on `app.state.server` (a `ServerState`, set by the app's lifespan). Tests swap
any piece with `app.dependency_overrides[get_engine] = lambda: fake`.

The dependencies are coroutines on purpose: FastAPI runs a plain `def` dependency in a worker
thread, and six thread hops per request were ~7 % of the event loop's time under streaming load.
Code that is not a dependency reads the state with `state_of(request)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from tokenizers import Tokenizer

from engine.client import EngineClient
from engine.structured import GrammarCompiler
from recipe.convert import Recipe
from server.admission import AdmissionController
from server.config import ServerConfig
from server.errors import APIError, ErrorKind
from server.metrics import ServerMetrics


@dataclass
class ServerState:
    """What one running app owns. `engine` and `tokenizer` are None until the lifespan starts."""

    config: ServerConfig
    metrics: ServerMetrics
    admission: AdmissionController
    engine: EngineClient | None = None
    tokenizer: Tokenizer | None = None
    recipe: Recipe | None = None
    grammar_compiler: GrammarCompiler | None = None


def state_of(request: Request) -> ServerState:
    return request.app.state.server


async def get_state(request: Request) -> ServerState:
    return state_of(request)


async def get_config(request: Request) -> ServerConfig:
    return state_of(request).config


async def get_metrics(request: Request) -> ServerMetrics:
    return state_of(request).metrics


async def get_admission(request: Request) -> AdmissionController:
    return state_of(request).admission


async def get_engine(request: Request) -> EngineClient:
    """The running engine; 503 (529 on Messages routes) before startup or after shutdown."""
    engine = state_of(request).engine
    if engine is None:
        raise APIError(ErrorKind.UNAVAILABLE, "the engine is not running")
    return engine


async def get_tokenizer(request: Request) -> Tokenizer:
    tokenizer = state_of(request).tokenizer
    if tokenizer is None:
        raise APIError(ErrorKind.UNAVAILABLE, "the tokenizer is not loaded")
    return tokenizer


def resolve_model_name(config: ServerConfig, requested: str | None) -> str:
    """The served name for a request's `model` field; 404 `model_not_found` if not served.

    None (field omitted) means the default name.
    """
    if requested is None:
        return config.model_name
    if requested not in config.served_model_names:
        raise APIError(
            ErrorKind.NOT_FOUND,
            f"model {requested!r} not found; this server serves "
            + ", ".join(repr(n) for n in config.served_model_names),
            param="model",
            code="model_not_found",
        )
    return requested
