"""`create_app(config)`: the FastAPI app, whose lifespan owns the engine.

    app = create_app(ServerConfig())            # builds the engine from config.engine
    app = create_app(config, engine=engine)     # tests: a prebuilt (not yet started) engine

The lifespan builds the engine unless one is given, loads the tokenizer from the model's
checkpoint folder unless one is given, builds the protocol layer and the grammar compiler for
the model's vocabulary, starts the engine, and on shutdown lets in-flight
requests drain (bounded) before stopping it. Routes reach everything through
`server.dependencies`.

Middleware, outermost first: request id + unhandled errors (`server.request_id`), shutdown
drain (`server.drain`, its controller on `app.state.drain`), API key (`server.auth`), request
body checks (`server.limits`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from tokenizers import Tokenizer

from engine.async_engine import AsyncEngine
from engine.client import EngineClient, as_client, build_engine_client
from engine.structured import DSML_MARKER, GrammarCompiler
from recipe.convert import Recipe, RecipeConfig
from recipe.errors import RecipeError
from recipe.sealing import ReasoningSealer
from recipe.tokenizer import load_tokenizer as load_model_tokenizer
from server.admission import AdmissionController
from server.auth import ApiKeyMiddleware
from server.config import ServerConfig
from server.dependencies import ServerState
from server.drain import DrainController, DrainMiddleware
from server.errors import install_error_handlers
from server.limits import RequestBodyMiddleware
from server.metrics import ServerMetrics
from server.request_id import RequestIdMiddleware
from server.routes import common, protocols

logger = logging.getLogger(__name__)


def checkpoint_folder(engine: EngineClient) -> Path:
    folder = engine.info.checkpoint_path
    if folder is None:
        raise RuntimeError("the engine's model has no checkpoint folder; pass a tokenizer")
    return Path(folder)


def load_tokenizer(engine: EngineClient) -> Tokenizer:
    """The `tokenizer.json` of the checkpoint folder the engine's model was loaded from."""
    return Tokenizer.from_file(str(checkpoint_folder(engine) / "tokenizer.json"))


def build_recipe(engine: EngineClient, config: ServerConfig) -> Recipe:
    """The protocol layer over the checkpoint's own tokenizer and the engine's context limit."""
    key_file = config.reasoning_key_file
    return Recipe(
        load_model_tokenizer(checkpoint_folder(engine)),
        RecipeConfig(
            model_names=config.served_model_names,
            context_len=engine.info.max_model_len,
            vocab_size=engine.info.vocab_size,
            default_max_tokens=config.default_max_tokens,
            max_tokens_limit=config.max_tokens_limit,
            default_thinking_mode=config.default_thinking,
            traffic_classes=config.engine.traffic_classes,
        ),
        ReasoningSealer.from_file(key_file) if key_file else None,
    )


def build_grammar_compiler(engine: EngineClient, recipe: Recipe) -> GrammarCompiler:
    """The grammar compiler for the model's vocabulary (logits width) with EOS as the stop,
    its tool-call marker's guard computed (the first tool-constrained request would otherwise
    hold the event loop for it)."""
    info = engine.info
    compiler = GrammarCompiler.for_tokenizer(
        recipe.tokenizer.full, info.vocab_size, info.eos_token_id
    )
    compiler.marker_guard(DSML_MARKER)
    return compiler


def create_app(
    config: ServerConfig,
    engine: EngineClient | AsyncEngine | None = None,
    tokenizer: Tokenizer | None = None,
    on_engine_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app for `config`; `engine` / `tokenizer` replace the ones the lifespan would build.

    The lifespan starts the engine (given or built; `config.parallel` picks in process or
    rank processes) and shuts it down, so an engine serves one app. `on_engine_failure` is
    called when a built multi-process engine fails (the CLI exits).
    """
    state = ServerState(
        config=config,
        metrics=ServerMetrics(config.model_name),
        admission=AdmissionController(config.max_queued_requests),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        built = None if engine is None else as_client(engine)
        if built is None:
            logger.info("loading model %s", config.engine.model)
            built = await asyncio.to_thread(
                build_engine_client, config.engine, config.parallel, on_engine_failure
            )
        state.tokenizer = tokenizer or await asyncio.to_thread(load_tokenizer, built)
        try:
            state.recipe = await asyncio.to_thread(build_recipe, built, config)
        except Exception as exc:  # e.g. `tiny`: its tokenizer has no chat-template tokens
            logger.warning("protocol routes disabled: %s", exc)
        else:
            state.grammar_compiler = await asyncio.to_thread(
                build_grammar_compiler, built, state.recipe
            )
        await built.start()
        state.engine = built
        # What startup built (model, tokenizer, grammar compiler) moves out of the collector's
        # generations: a full collection, which a request allocating millions of objects (a
        # long /tokenize) triggers while holding the GIL, then no longer walks it (measured:
        # 0.5 s per collection over 8 M objects, a stalled event loop).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            await built.shutdown(drain=True, timeout=config.shutdown_timeout_s)

    async def abort_all() -> None:
        if state.engine is not None:
            await state.engine.shutdown(drain=False)

    app = FastAPI(title="deepinfer-server", lifespan=lifespan)
    app.state.server = state
    app.state.drain = DrainController(abort_all)
    install_error_handlers(app)
    app.add_middleware(RequestBodyMiddleware, max_request_bytes=config.max_request_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(DrainMiddleware, controller=app.state.drain)
    app.add_middleware(RequestIdMiddleware)
    app.add_exception_handler(RecipeError, protocols.recipe_error_response)
    app.include_router(common.router)
    app.include_router(protocols.router)
    return app
