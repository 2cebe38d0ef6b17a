"""`deepinfer-server` / `python -m server`: parse options, build the configs, run uvicorn."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.async_engine import EngineConfig
from server.config import ServerConfig

_ENGINE_DEFAULTS = EngineConfig()
_SERVER_DEFAULTS = ServerConfig()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer-server",
        description="OpenAI- and Anthropic-compatible server for DeepSeek-V4.1-Flash.",
    )
    add = parser.add_argument
    add("--host", default=_SERVER_DEFAULTS.host, help="address to listen on")
    add("--port", type=int, default=_SERVER_DEFAULTS.port, help="port to listen on")
    add(
        "--model",
        default=_ENGINE_DEFAULTS.model,
        help="preset (`default`, `tiny`: random weights generated once into the cache folder) "
        "or a checkpoint folder / Hugging Face hub id",
    )
    add("--device", default=_ENGINE_DEFAULTS.device, help="torch device, e.g. cpu or cuda")
    add("--dtype", default=_ENGINE_DEFAULTS.dtype, choices=["float32", "bfloat16", "float16"])
    add("--api-key", default=None, help="require this key (Bearer / x-api-key)")
    add("--max-num-seqs", type=int, default=_ENGINE_DEFAULTS.max_num_seqs)
    add("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    add("--kv-cache-tokens", type=int, default=_ENGINE_DEFAULTS.kv_cache_tokens)
    add(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly (no CUDA graphs)",
    )
    add(
        "--target-step-ms",
        type=float,
        default=None,
        help="prefill chunks are sized so that an engine step stays within this time (a cost "
        "model fitted to the engine's own steps); default 2000 on the CPU, 500 on CUDA",
    )
    add(
        "--max-queued-requests",
        type=int,
        default=_SERVER_DEFAULTS.max_queued_requests,
        help="requests admitted at once; more get 429 (OpenAI) / 529 (Anthropic)",
    )
    add(
        "--grammar-compile-timeout",
        type=float,
        default=_SERVER_DEFAULTS.grammar_compile_timeout_s,
        help="seconds a JSON schema / regex / EBNF / tool list may take to compile (else 400)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the configs; invalid combinations raise ValueError from their `__post_init__`."""
    max_num_seqs = args.max_num_seqs
    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(_ENGINE_DEFAULTS.max_num_batched_tokens, max_num_seqs),
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        cuda_graphs=not args.enforce_eager,
        target_step_ms=args.target_step_ms,
    )
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        engine=engine,
    )


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from server.app import create_app

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="info")
