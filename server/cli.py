"""`deepinfer-server` / `python -m server`: parse options, build the configs, bind the port, run
uvicorn (which loads the model in the app's lifespan).

The port is bound before anything loads, so a port in use fails in a second with a clear
message instead of after the model load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Sequence

import torch

from engine.async_engine import (
    AUTO_DTYPE,
    CUDA_GRAPH_MODES,
    DENSE_GEMMS,
    ENGRAM_PLACEMENTS,
    KV_STORAGES,
    EngineConfig,
)
from engine.distributed.config import ParallelConfig
from server.config import ServerConfig

_ENGINE_DEFAULTS = EngineConfig()
_SERVER_DEFAULTS = ServerConfig()
_PARALLEL_DEFAULTS = ParallelConfig()
ENGINE_FAILURE_EXIT_DELAY_S = 2.0  # /health answers 503 this long before a failed server exits
logger = logging.getLogger(__name__)
AUTO_DEVICE = "auto"  # CUDA when torch sees a GPU, else the CPU


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows `(default: X)` after each option that has a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def resolve_device(device: str) -> str:
    """`auto` → `cuda` when torch sees a GPU, else `cpu`; any other torch device as given."""
    if device != AUTO_DEVICE:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening; uvicorn listens once the model is
    loaded). Raises OSError when the address is in use or cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not past a live listener
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _byte_size(text: str) -> int:
    """`1073741824`, `512M`, `64G`, `2T` (binary units) → bytes."""
    number, unit = text.strip().upper().rstrip("IB") or "0", ""
    if number[-1:] in _BYTE_UNITS:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * _BYTE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a byte size must be >= 1: {text!r}")
    return value


def _byte_size_or_zero(text: str) -> int:
    """`_byte_size`, or 0 (off)."""
    return 0 if text.strip() == "0" else _byte_size(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer-server",
        description="OpenAI- and Anthropic-compatible server for DeepSeek-V4.1-Flash.",
        formatter_class=_DefaultsFormatter,
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
    add(
        "--device",
        default=AUTO_DEVICE,
        help="torch device, e.g. cpu, cuda, cuda:1; `auto` is cuda when a GPU is visible, else cpu",
    )
    add(
        "--dtype",
        default=AUTO_DTYPE,
        choices=[AUTO_DTYPE, "float32", "bfloat16", "float16"],
        help="activation dtype; auto = bfloat16 on CUDA (routed experts stay MXFP4 for the "
        "grouped kernel, CUDA graphs), float32 on the CPU",
    )
    add("--api-key", default=None, help="require this key (Bearer / x-api-key)")
    add(
        "--served-model-name",
        nargs="+",
        default=list(_SERVER_DEFAULTS.served_model_names),
        metavar="NAME",
        help="names requests may use in `model` (the first is reported in responses); "
        "independent of --model",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=_ENGINE_DEFAULTS.max_num_seqs,
        help="sequences decoded together",
    )
    add("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    add(
        "--kv-cache-tokens",
        type=int,
        default=_ENGINE_DEFAULTS.kv_cache_tokens,
        help="global KV cache capacity in tokens, shared by the running sequences",
    )
    add(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly (no CUDA graphs)",
    )
    add(
        "--cuda-graph-mode",
        choices=list(CUDA_GRAPH_MODES),
        default=_ENGINE_DEFAULTS.cuda_graph_mode,
        help="segments: replay each block's pure parts from CUDA graphs; step: also replay "
        "every plain decode step whole from one graph per step shape (default: step where it "
        "applies: CUDA, bfloat16, no speculation, not batch-invariant, one rank)",
    )
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule engine step N+1 while step N runs (same tokens); default: on for CUDA, "
        "off on the CPU",
    )
    add(
        "--speculative",
        choices=["off", "dspark"],
        default=None,
        help="speculative decoding with the checkpoint's DSpark drafter (lossless: the same "
        "tokens at temperature 0, the same distribution when sampling); default: dspark on "
        "CUDA when the checkpoint has the drafter, off on the CPU. Runs under async "
        "scheduling as without (--no-async-scheduling: the synchronous loop)",
    )
    add(
        "--num-speculative-tokens",
        type=int,
        default=_ENGINE_DEFAULTS.num_speculative_tokens,
        help="drafts proposed per request and step (1 to the drafter's block of 5)",
    )
    add(
        "--speculative-verify",
        choices=["scheduled", "fixed"],
        default=_ENGINE_DEFAULTS.speculative_verify,
        help="how many drafts a step verifies: fixed = all; scheduled = the planner's budget "
        "from lagged confidences over a profiled step-time table",
    )
    add(
        "--speculative-acceptance",
        choices=["rejection", "block", "coupled"],
        default=_ENGINE_DEFAULTS.speculative_acceptance,
        help="sampled requests: rejection sampling token by token or block verification (both "
        "the same distribution as without speculation; block never accepts fewer drafts in "
        "expectation), or coupled noise (seeded output bit-identical to decoding without "
        "speculation)",
    )
    add(
        "--speculative-calibration",
        default=None,
        metavar="PATH",
        help="STS calibration of the DSpark confidence head (a file from `python -m "
        "engine.speculative.sts fit`, fitted for --num-speculative-tokens drafts); default: "
        "the head's raw confidences",
    )
    add(
        "--speculative-record",
        default=None,
        metavar="PATH",
        help="append (confidences, drafts accepted, temperature) of every uncensored "
        "request-step (all drafts verified, or one rejected) to this JSON-lines file, to fit a "
        "calibration from",
    )
    add(
        "--kv-storage",
        choices=list(KV_STORAGES),
        default=_ENGINE_DEFAULTS.kv_storage,
        help="how KV rows are stored: quantized (MXFP8 window rows, FP4 global rows and index "
        "keys, as the model was trained) or exact (the compute dtype: batch composition moves "
        "greedy tokens only through rounding, more memory; --batch-invariant for bit-identical "
        "logits)",
    )
    add(
        "--dense-gemm",
        choices=list(DENSE_GEMMS),
        default=_ENGINE_DEFAULTS.dense_gemm,
        help="the checkpoint's FP8 dense linears (attention, shared experts): bf16 = "
        "dequantised at load (reference numerics); fp8 = kept FP8 and run on FP8 tensor cores "
        "with activations quantized per (row, 32 columns), half the bytes (CUDA, bfloat16, "
        "quantized KV storage); fp8-weights = kept FP8 and multiplied with bf16 activations, "
        "the products of bf16 from half the bytes (CUDA, bfloat16)",
    )
    add(
        "--batch-invariant",
        action="store_true",
        help="a request's logits do not depend on what else is in the batch: fixed-order "
        "matmul, attention and indexer reductions (slower; see docs/model.md)",
    )
    add(
        "--target-step-ms",
        type=float,
        default=None,
        help="prefill chunks are sized so that an engine step stays within this time (a cost "
        "model fitted to the engine's own steps); default 2000 on the CPU, 500 on CUDA",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS.enable_prefix_caching,
        help="reuse the KV of 128-token prompt blocks seen before (on by default)",
    )
    add(
        "--swa-replay",
        choices=["bounded", "exact"],
        default=_ENGINE_DEFAULTS.swa_replay,
        help="what a prefix-cache hit recomputes: one block, with the decoder layers on the "
        "last 128 rows only (bounded, approximate) or as many blocks as the sliding windows "
        "reach, through every layer (exact: equals a full prefill)",
    )
    add(
        "--host-kv-cache-bytes",
        type=_byte_size_or_zero,
        default=None,
        help="host-memory tier of the prefix cache under the GPU one (pinned on CUDA, LRU; "
        "suffixes K, M, G, T; 0 disables); default 20%% of the memory available at start, "
        "split between this machine's ranks",
    )
    add(
        "--engram-placement",
        choices=list(ENGRAM_PLACEMENTS),
        default=_ENGINE_DEFAULTS.engram_placement,
        help="where the Engram tables live: on each rank's device, or in host memory mapped "
        "from the checkpoint (one copy per node shared by its ranks; rows gathered and copied "
        "to the device per step); auto = host on the CPU or with --ep > 1, else device",
    )
    add(
        "--resume-slot-memory",
        type=_byte_size_or_zero,
        default=_ENGINE_DEFAULTS.resume_slot_memory,
        help="host memory for resume slots: the private state of finished sequences, so that a "
        "prompt extending one (an agent's next turn) computes only its new tokens, exactly "
        "(suffixes K, M, G, T; 0 = off; default 4G)",
    )
    add(
        "--advertise-url",
        default=None,
        metavar="URL",
        help="this server's base URL as the other servers sharing --kv-cache-shared-dir reach "
        "it, to pull its resume slots (default http://HOST:PORT, the hostname for 0.0.0.0)",
    )
    add(
        "--kv-cache-dir",
        default=None,
        metavar="PATH",
        help="a local directory (SSD) holding KV blocks under the GPU cache",
    )
    add(
        "--kv-cache-dir-bytes",
        type=_byte_size,
        default=_ENGINE_DEFAULTS.kv_cache_dir_bytes,
        help="byte budget of --kv-cache-dir (GC from 90%% down to 80%%; suffixes K, M, G, T)",
    )
    add(
        "--kv-cache-shared-dir",
        default=None,
        metavar="PATH",
        help="a directory on a filesystem shared by several servers (3FS, NFS, Lustre, "
        "CephFS): a prompt prefilled by one is a cache hit on the others",
    )
    add(
        "--kv-cache-shared-dir-bytes",
        type=_byte_size,
        default=_ENGINE_DEFAULTS.kv_cache_shared_dir_bytes,
        help="byte budget of --kv-cache-shared-dir (suffixes K, M, G, T)",
    )
    add(
        "--kv-ttl",
        default=_ENGINE_DEFAULTS.kv_ttl,
        help="how long a block lives in the KV cache directories after its last use, per "
        "traffic class (`traffic_class` field / X-Deepinfer-Traffic-Class header; default "
        "agent with tools, else chat)",
    )
    add(
        "--kv-cache-report",
        default=None,
        metavar="DIR",
        help="print what the KV cache directory DIR holds (blocks and bytes by traffic class "
        "and age, against --kv-cache-dir-bytes, expired blocks, the GC lease) and exit; "
        "read-only, safe on a directory servers are using",
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
    add(
        "--default-max-tokens",
        type=int,
        default=None,
        help="output tokens of a request that sets none (default: the rest of the context)",
    )
    add(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="most output tokens a request may ask for: Chat/Responses answer 400 above it, "
        "Messages lowers it (default: 393216, i.e. the context)",
    )
    add(
        "--reasoning-key-file",
        default=None,
        help="file with >= 32 secret bytes sealing Responses reasoning (encrypted_content) "
        "across restarts and replicas (default: a random key per process)",
    )
    add(
        "--max-request-bytes",
        type=int,
        default=_SERVER_DEFAULTS.max_request_bytes,
        help="largest request body accepted (larger: 413)",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=_SERVER_DEFAULTS.shutdown_timeout_s,
        help="on SIGTERM, seconds in-flight requests get to finish before they are ended",
    )
    add(
        "--keep-alive-timeout",
        type=float,
        default=_SERVER_DEFAULTS.keep_alive_timeout_s,
        help="seconds an idle HTTP connection stays open (above the clients' 5 s idle expiry)",
    )
    add(
        "--default-thinking",
        choices=["on", "off"],
        default="on" if _SERVER_DEFAULTS.default_thinking else "off",
        help="whether Chat and Responses requests that do not say think; Messages requests "
        "without `thinking` never think (Anthropic's rule)",
    )
    _add_parallel_options(parser)
    return parser


def _add_parallel_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-GPU (expert parallelism + attention data parallelism)")
    add = group.add_argument
    add(
        "--ep",
        type=int,
        default=_PARALLEL_DEFAULTS.ep_size,
        help="engine ranks, one process per device, all nodes together: routed experts split "
        "across them, each owning its requests and KV; 1 runs one engine (in a process of its "
        "own on CUDA: see --engine-process)",
    )
    add(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --ep 1: run the engine in a process of its own, so that the HTTP event loop "
        "and the engine's host work do not share one Python interpreter lock (default: on "
        "with --ep 1 on CUDA, where it streams 2.3x the tokens at 256 streams; off on the CPU)",
    )
    add(
        "--nnodes",
        type=int,
        default=_PARALLEL_DEFAULTS.nnodes,
        help="machines (ranks split evenly)",
    )
    add(
        "--node-rank",
        type=int,
        default=_PARALLEL_DEFAULTS.node_rank,
        help="this machine's index; node 0 serves HTTP, the others only run ranks",
    )
    add(
        "--master-addr",
        default=_PARALLEL_DEFAULTS.master_addr,
        help="node 0's address (torch.distributed rendezvous and the ranks' connection)",
    )
    add(
        "--master-port",
        type=int,
        default=None,
        help="torch.distributed port on node 0 (the API listens for ranks on the next port); "
        "required with --nnodes > 1, default: free ports",
    )
    add(
        "--dist-timeout",
        type=float,
        default=_PARALLEL_DEFAULTS.timeout_s,
        help="seconds a collective waits for a missing rank before the engine fails",
    )


def _own_url(host: str, port: int) -> str:
    """This server's base URL for the other servers of a shared cache directory."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{host}:{port}"


def _engine_process(requested: bool | None, ep_size: int, device: str) -> bool:
    """`--[no-]engine-process` as given; by default a process of its own for the one rank on
    CUDA (the CPU keeps the engine in the API process: one process to start and debug)."""
    if requested is not None:
        return requested
    return ep_size == 1 and torch.device(device).type == "cuda"


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the configs; invalid combinations raise ValueError from their `__post_init__`."""
    max_num_seqs = args.max_num_seqs
    device = resolve_device(args.device)
    parallel = ParallelConfig(
        ep_size=args.ep,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        timeout_s=args.dist_timeout,
        engine_process=_engine_process(args.engine_process, args.ep, device),
    )
    engine = EngineConfig(
        model=args.model,
        device=device,
        dtype=args.dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(_ENGINE_DEFAULTS.max_num_batched_tokens, max_num_seqs),
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        cuda_graphs=not args.enforce_eager,
        cuda_graph_mode=args.cuda_graph_mode,
        target_step_ms=args.target_step_ms,
        enable_prefix_caching=args.enable_prefix_caching,
        swa_replay=args.swa_replay,
        engram_placement=args.engram_placement,
        async_scheduling=args.async_scheduling,
        kv_cache_dir=args.kv_cache_dir,
        resume_slot_memory=args.resume_slot_memory,
        resume_slot_url=args.advertise_url or _own_url(args.host, args.port),
        kv_cache_dir_bytes=args.kv_cache_dir_bytes,
        kv_cache_shared_dir=args.kv_cache_shared_dir,
        kv_cache_shared_dir_bytes=args.kv_cache_shared_dir_bytes,
        kv_ttl=args.kv_ttl,
        host_kv_cache_bytes=args.host_kv_cache_bytes,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_verify=args.speculative_verify,
        speculative_acceptance=args.speculative_acceptance,
        kv_storage=args.kv_storage,
        dense_gemm=args.dense_gemm,
        batch_invariant=args.batch_invariant,
        speculative_calibration=args.speculative_calibration,
        speculative_record=args.speculative_record,
    )
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=tuple(args.served_model_name),
        max_queued_requests=args.max_queued_requests,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        default_max_tokens=args.default_max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        reasoning_key_file=args.reasoning_key_file,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        default_thinking=args.default_thinking == "on",
        engine=engine,
        parallel=parallel,
    )


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from server.app import create_app
    from server.drain import STOP_GRACE_S, DrainingServer

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kv_cache_report is not None:
        raise SystemExit(_kv_cache_report(parser, args))
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if config.parallel.node_rank > 0:
        from engine.distributed.multiprocess import serve_ranks

        given = _node_options_given(parser, args)
        if given:
            parser.error(
                f"node {config.parallel.node_rank} serves what node 0 tells it (its model and "
                "engine options); pass only --device and the multi-GPU options here, not "
                + ", ".join(given)
            )
        raise SystemExit(serve_ranks(config.engine.device, config.parallel))
    if config.parallel.ep_size > 1:
        from engine.distributed.memory import check_ep_size

        try:
            check_ep_size(config.engine, config.parallel.ep_size)
        except ValueError as exc:
            parser.error(str(exc))
    sock = _bind_or_exit(config.host, config.port)
    # The model load and a first checkpoint generation report their steps on stderr.
    host, port = sock.getsockname()[:2]
    logger.info("bound http://%s:%d; it answers once the model is loaded", host, port)
    failures: list[str] = []
    server: DrainingServer

    def on_engine_failure(reason: str) -> None:
        # NOTE: runs on the event loop; /health answers 503 until uvicorn stops.
        failures.append(reason)
        loop = asyncio.get_running_loop()
        loop.call_later(ENGINE_FAILURE_EXIT_DELAY_S, setattr, server, "should_exit", True)

    app = create_app(config, on_engine_failure=on_engine_failure)
    server = DrainingServer(
        # The timeout is a backstop: the drain has ended every request by then.
        uvicorn.Config(
            app,
            log_level="info",
            timeout_graceful_shutdown=int(STOP_GRACE_S) + 1,
            timeout_keep_alive=config.keep_alive_timeout_s,
        ),
        app.state.drain,
        config.shutdown_timeout_s,
    )
    # uvicorn re-raises the SIGINT it stopped on; `uvicorn.run` swallows it the same way.
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    if failures:
        logger.error("exiting: the engine failed (%s)", failures[0])
        raise SystemExit(1)
    if not server.started:
        raise SystemExit(3)  # uvicorn's startup failure status


_NODE_OPTIONS = frozenset(
    {"device", "ep", "nnodes", "node_rank", "master_addr", "master_port", "dist_timeout"}
)


def _node_options_given(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options other than `_NODE_OPTIONS` set away from their defaults (a node > 0 gets
    them from node 0, so setting them there would be ignored)."""
    return [
        "--" + dest.replace("_", "-")
        for dest, value in vars(args).items()
        if dest not in _NODE_OPTIONS and value != parser.get_default(dest)
    ]


def _kv_cache_report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`--kv-cache-report DIR`: print the directory's report; 0, or 2 when DIR is no cache."""
    from engine.client import kv_cache_report

    root = args.kv_cache_report
    try:
        print(kv_cache_report(root, args.kv_ttl, args.kv_cache_dir_bytes))
    except ValueError as exc:
        parser.error(str(exc))
    except (FileNotFoundError, NotADirectoryError):
        print(f"deepinfer-server: {root} holds no KV cache (no kv1/ directory)", file=sys.stderr)
        return 2
    return 0


def _bind_or_exit(host: str, port: int) -> socket.socket:
    try:
        return bind_socket(host, port)
    except OSError as exc:
        reason = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc})"
        print(f"deepinfer-server: {host}:{port} {reason}", file=sys.stderr)
        raise SystemExit(1) from None
