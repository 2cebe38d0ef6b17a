"""ServerConfig: what the HTTP layer needs (the engine's own config rides along, untouched)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.async_engine import EngineConfig
from engine.distributed.config import ParallelConfig

API_MODEL_NAME = "DeepSeek-V4.1-Flash"


@dataclass(frozen=True)
class ServerConfig:
    """Options of the HTTP server.

    host / port: where uvicorn listens.
    api_key: when set, every route except `/health` and `/metrics` needs it (`Authorization:
        Bearer` on OpenAI routes, `x-api-key` on Messages routes); None leaves the API open.
    max_queued_requests: generation requests admitted at once (waiting + running in the
        engine); one more is answered 429 (OpenAI routes) or 529 (Messages routes).
    served_model_names: names accepted in a request's `model` field; the first is the one
        `/v1/models` lists first and responses report.
    grammar_compile_timeout_s: longest wait for a grammar (JSON schema, regex, EBNF, tool
        list) to compile; a request whose grammar takes longer is answered 400.
    default_max_tokens / max_tokens_limit: see `recipe.RecipeConfig` (None: the recipe's).
    reasoning_key_file: the key that seals Responses reasoning (`encrypted_content`), so it
        opens across restarts and replicas; None: a random key per process.
    max_request_bytes: largest request body accepted; a larger one is answered 413.
    shutdown_timeout_s: on SIGTERM, how long in-flight requests get to finish before the rest
        are ended with an error (`server.drain`).
    keep_alive_timeout_s: how long an idle HTTP connection stays open for the client's next
        request. Longer than the clients' own idle expiry (httpx, so the OpenAI and Anthropic
        SDKs: 5 s; load balancers: 60 s), so the client closes first: a server closing at the
        same moment races a request the client is sending on it, which fails with no response.
    default_thinking: Chat and Responses requests that do not say think (True) or not;
        Messages requests without `thinking` never think (Anthropic's rule).
    engine: the engine's config, used when the app builds its own engine.
    parallel: how many engine ranks (`--ep`; 1: the engine runs in the API process).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int = 256
    served_model_names: tuple[str, ...] = (API_MODEL_NAME,)
    grammar_compile_timeout_s: float = 10.0
    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None
    reasoning_key_file: str | None = None
    max_request_bytes: int = 8 * 1024 * 1024
    shutdown_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 65.0
    default_thinking: bool = True
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], not {self.port}")
        if not self.host:
            raise ValueError("host must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be blank (leave it unset for an open server)")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be > 0")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be >= 1024")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
        if not self.keep_alive_timeout_s > 0:
            raise ValueError("keep_alive_timeout_s must be > 0")
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1")
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names needs at least one non-empty name")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError("served_model_names must not repeat a name")
        for name in ("default_max_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]
