from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine.async_engine import AsyncEngine, EngineConfig
from server.cli import build_parser, config_from_args, main
from server.config import API_MODEL_NAME, ServerConfig

REPO = Path(__file__).parents[2]


def test_defaults_serve_the_api_model_name():
    config = ServerConfig()
    assert config.model_name == API_MODEL_NAME == "DeepSeek-V4.1-Flash"
    assert config.api_key is None and config.engine == EngineConfig()


@pytest.mark.parametrize(
    "overrides",
    [
        {"port": 70000},
        {"host": ""},
        {"api_key": "  "},
        {"max_queued_requests": 0},
        {"served_model_names": ()},
        {"served_model_names": ("a", "a")},
    ],
)
def test_invalid_config_is_rejected(overrides):
    with pytest.raises(ValueError):
        ServerConfig(**overrides)


def test_cli_builds_configs():
    args = build_parser().parse_args(
        [
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--api-key",
            "k",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "2048",
            "--kv-cache-tokens",
            "4096",
            "--max-queued-requests",
            "3",
            "--enforce-eager",
        ]
    )
    config = config_from_args(args)
    assert (config.host, config.port, config.api_key, config.max_queued_requests) == (
        "0.0.0.0",
        9000,
        "k",
        3,
    )
    engine = config.engine
    assert (engine.model, engine.device, engine.dtype) == ("tiny", "cpu", "bfloat16")
    assert (engine.max_num_seqs, engine.max_model_len, engine.kv_cache_tokens) == (8, 2048, 4096)
    assert engine.cuda_graphs is False


def test_cli_defaults_to_the_default_model():
    config = config_from_args(build_parser().parse_args([]))
    assert config.engine.model == "default" and config.port == 8000
    assert config.engine.cuda_graphs is True


def test_cli_reports_invalid_values(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--kv-cache-tokens", "5"])
    assert exit_info.value.code == 2
    assert "kv_cache_tokens" in capsys.readouterr().err


def test_help_shows_the_defaults():
    text = " ".join(build_parser().format_help().split())
    for shown in (
        "port to listen on (default: 8000)",
        "(default: 127.0.0.1)",
        "Hugging Face hub id (default: default)",
        "else cpu (default: auto)",
        "float32 on the CPU (default: auto)",
        "(default: 64)",
        "(default: 262144)",
        "(default: 256)",
        "(default: 10.0)",
    ):
        assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_auto_device_is_cuda_only_when_torch_sees_a_gpu():
    config = config_from_args(build_parser().parse_args([]))
    assert config.engine.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert config_from_args(build_parser().parse_args(["--device", "cpu"])).engine.device == "cpu"


def test_a_port_in_use_fails_at_once_before_the_model_loads(tmp_path):
    """The port is bound before the model loads: a second server exits 1 within seconds."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "server", "--port", str(port), "--model", "default"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env={**os.environ, "DEEPINFER_CACHE_DIR": str(tmp_path)},  # no checkpoint: no load
        )
        elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert f"127.0.0.1:{port} is in use" in result.stderr
    assert "loading model" not in result.stderr
    assert not any(tmp_path.iterdir())  # the embedded checkpoint was not even generated
    assert elapsed < 30, elapsed  # python + torch import; a model load takes far longer


def test_cli_output_limits_and_reasoning_key(tmp_path):
    defaults = config_from_args(build_parser().parse_args([]))
    assert (defaults.default_max_tokens, defaults.max_tokens_limit) == (None, None)
    assert defaults.reasoning_key_file is None
    key = tmp_path / "key"
    args = build_parser().parse_args(
        [
            "--default-max-tokens",
            "2048",
            "--max-tokens-limit",
            "8192",
            "--reasoning-key-file",
            str(key),
        ]
    )
    config = config_from_args(args)
    assert (config.default_max_tokens, config.max_tokens_limit) == (2048, 8192)
    assert config.reasoning_key_file == str(key)
    with pytest.raises(ValueError):
        ServerConfig(default_max_tokens=0)


def test_cli_body_limit_and_shutdown_timeout():
    defaults = config_from_args(build_parser().parse_args([]))
    assert defaults.max_request_bytes == 8 * 1024 * 1024 and defaults.shutdown_timeout_s == 30.0
    args = build_parser().parse_args(["--max-request-bytes", "65536", "--shutdown-timeout", "2.5"])
    config = config_from_args(args)
    assert config.max_request_bytes == 65536 and config.shutdown_timeout_s == 2.5
    for bad in ({"max_request_bytes": 10}, {"shutdown_timeout_s": -1.0}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_cli_async_scheduling_flag():
    def parsed(*argv: str) -> bool | None:
        return config_from_args(build_parser().parse_args(list(argv))).engine.async_scheduling

    assert parsed() is None  # the engine decides by device
    assert parsed("--no-async-scheduling") is False
    assert parsed("--async-scheduling") is True


def test_cli_engine_process_flag(capsys):
    def parallel(*argv: str):
        return config_from_args(build_parser().parse_args(list(argv))).parallel

    assert parallel("--device", "cpu").engine_process is False  # in the API process
    assert parallel("--device", "cpu", "--engine-process").engine_process is True
    # on CUDA the one rank runs in a process of its own unless told otherwise
    assert parallel("--device", "cuda").engine_process is True
    assert parallel("--device", "cuda:1", "--no-engine-process").engine_process is False
    assert parallel("--device", "cuda", "--ep", "2").engine_process is False  # N ranks already
    with pytest.raises(SystemExit) as exit_info:
        main(["--ep", "2", "--engine-process"])
    assert exit_info.value.code == 2
    assert "engine_process is for one rank" in capsys.readouterr().err


def test_cli_batch_invariant_flag_reaches_the_model_numerics():
    def engine(*argv: str):
        return config_from_args(build_parser().parse_args(list(argv))).engine

    assert not engine().batch_invariant and not engine().numerics.batch_invariant
    config = engine("--batch-invariant")
    assert config.batch_invariant and config.numerics.batch_invariant
    assert config.numerics.kv_quantize
    with pytest.raises(ValueError, match="batch-invariant"):
        EngineConfig(batch_invariant=True, dense_gemm="fp8", device="cuda", dtype="bfloat16")


def test_cli_host_tier_budget(tiny_model, caplog: pytest.LogCaptureFixture) -> None:
    def engine(*argv: str) -> EngineConfig:
        return config_from_args(build_parser().parse_args(list(argv))).engine

    assert engine().host_kv_cache_bytes is None  # the engine's default: a share of free memory
    assert engine("--host-kv-cache-bytes", "0").host_kv_cache_bytes == 0  # no host tier
    assert engine("--host-kv-cache-bytes", "2G").host_kv_cache_bytes == 2 << 30
    with pytest.raises(ValueError, match="host_kv_cache_bytes"):
        EngineConfig(host_kv_cache_bytes=-1)
    # `--ep 2` runs two ranks on this machine: each rank's engine prints and uses half the
    # default (measured by the engine, after its model is loaded).
    config = dataclasses.replace(
        engine("--ep", "2"), model="tiny", device="cpu", kv_cache_tokens=4096, max_model_len=2048
    )
    budgets, lines = {}, {}
    for ranks in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.async_engine"):
            built = AsyncEngine.from_model(tiny_model, config, num_local_ranks=ranks)
        [lines[ranks]] = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache host")
        ]
        pool = built.core.scheduler.prefix_reuse.host.pool.stats()
        budgets[ranks] = pool.num_slots * pool.slot_bytes
    assert "split between the 2 ranks of this machine" in lines[2]
    assert "split" not in lines[1]
    printed = float(re.search(r"([\d.]+) GiB", lines[2])[1]) * 2**30
    assert abs(printed - budgets[2]) < 2**30 / 100, (lines[2], budgets)
    assert 0.4 < budgets[2] / budgets[1] < 0.6, budgets


def test_cli_engram_placement():
    assert config_from_args(build_parser().parse_args([])).engine.engram_placement == "auto"
    args = build_parser().parse_args(["--engram-placement", "device"])
    assert config_from_args(args).engine.engram_placement == "device"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--engram-placement", "disk"])
    with pytest.raises(ValueError, match="engram placement must be one of"):
        EngineConfig(engram_placement="disk")


def test_cli_speculative_options():
    def engine(*argv: str) -> EngineConfig:
        return config_from_args(build_parser().parse_args(list(argv))).engine

    default = engine()
    assert default.speculative is None  # dspark on CUDA with a trained drafter, else off
    # The embedded presets are random weights: their drafter would only cost.
    assert default.speculative_config(on_cuda=True, has_drafter=True).method == "off"
    folder = engine("--model", "/models/DeepSeek-V4.1-Flash")
    assert folder.speculative_config(on_cuda=True, has_drafter=True).method == "dspark"
    assert folder.speculative_config(on_cuda=False, has_drafter=True).method == "off"
    assert folder.speculative_config(on_cuda=True, has_drafter=False).method == "off"
    asked = engine("--speculative", "dspark")
    assert asked.speculative_config(on_cuda=True, has_drafter=True).method == "dspark"
    assert (default.num_speculative_tokens, default.speculative_verify) == (5, "scheduled")
    chosen = engine(
        "--speculative",
        "dspark",
        "--num-speculative-tokens",
        "3",
        "--speculative-verify",
        "fixed",
        "--speculative-acceptance",
        "coupled",
    ).speculative_config(on_cuda=False, has_drafter=True)
    assert (chosen.method, chosen.num_speculative_tokens, chosen.acceptance) == (
        "dspark",
        3,
        "coupled",
    )
    block = engine("--speculative", "dspark", "--speculative-acceptance", "block")
    assert block.speculative_config(on_cuda=False, has_drafter=True).acceptance == "block"
    assert default.speculative_acceptance == "rejection"
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine("--num-speculative-tokens", "0")
    with pytest.raises(ValueError, match="DSpark drafter"):
        engine("--speculative", "dspark").speculative_config(on_cuda=True, has_drafter=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative", "eagle"])


def test_scheduled_verification_selects_the_scheduled_planner(tiny_model):
    from engine.speculative.planner import FixedPlanner, ScheduledPlanner

    def planner(verify: str):
        config = EngineConfig(
            model="tiny",
            kv_cache_tokens=4096,
            max_num_seqs=4,
            speculative="dspark",
            speculative_verify=verify,
        )
        return AsyncEngine.from_model(tiny_model, config).core.scheduler.speculation.planner

    scheduled = planner("scheduled")
    assert isinstance(scheduled, ScheduledPlanner) and scheduled.table is None  # eager: no table
    assert isinstance(planner("fixed"), FixedPlanner)


def test_cli_dense_gemm():
    def engine(*argv: str) -> EngineConfig:
        return config_from_args(build_parser().parse_args(list(argv))).engine

    assert engine().dense_gemm == "bf16" and not engine().numerics.dense_fp8
    chosen = engine("--device", "cuda", "--dtype", "bfloat16", "--dense-gemm", "fp8")
    assert chosen.numerics.dense_fp8 and chosen.numerics.kv_quantize
    with pytest.raises(ValueError, match="needs --device cuda and --dtype bfloat16"):
        engine("--device", "cpu", "--dense-gemm", "fp8")
    with pytest.raises(ValueError, match="needs --device cuda and --dtype bfloat16"):
        EngineConfig(device="cuda", dtype="float32", dense_gemm="fp8")
    with pytest.raises(ValueError, match="kv-storage exact"):
        EngineConfig(device="cuda", dtype="bfloat16", dense_gemm="fp8", kv_storage="exact")
    with pytest.raises(ValueError, match="dense_gemm must be one of"):
        EngineConfig(dense_gemm="int8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dense-gemm", "fp16"])
    # W8A16: the FP8 weights with bf16 activations, the same products (exact KV storage too)
    weights = engine("--device", "cuda", "--dtype", "bfloat16", "--dense-gemm", "fp8-weights",
                     "--kv-storage", "exact")  # fmt: skip
    numerics = weights.numerics
    assert numerics.dense_fp8 and not numerics.dense_fp8_activations and not numerics.kv_quantize
    assert chosen.numerics.dense_fp8_activations
    with pytest.raises(ValueError, match="needs --device cuda and --dtype bfloat16"):
        engine("--device", "cpu", "--dense-gemm", "fp8-weights")
    with pytest.raises(ValueError, match="K splits"):
        EngineConfig(device="cuda", dtype="bfloat16", dense_gemm="fp8-weights",
                     batch_invariant=True)  # fmt: skip


def test_cli_dtype_defaults_to_bfloat16_on_cuda_and_float32_on_the_cpu():
    """`--device cuda` alone serves bf16 with MXFP4 experts through the grouped kernel: with a
    float32 default it ran the per-expert reference path (host reads of the expert counts, so
    no CUDA graph captured) at 75 ms per token on the H200."""

    def engine(*argv: str) -> EngineConfig:
        return config_from_args(build_parser().parse_args(list(argv))).engine

    on_cuda = engine("--device", "cuda")
    assert on_cuda.dtype == "bfloat16" and on_cuda.quantized_experts
    assert engine("--device", "cpu").dtype == "float32"
    assert engine("--device", "cuda", "--dtype", "float32").dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16" and EngineConfig().dtype == "float32"
    with pytest.raises(SystemExit):
        engine("--dtype", "float64")


def test_cli_cuda_graph_mode(tiny_model, caplog: pytest.LogCaptureFixture) -> None:
    def engine(*argv: str) -> EngineConfig:
        return config_from_args(build_parser().parse_args(list(argv))).engine

    assert engine().cuda_graph_mode is None  # step wherever it applies
    assert engine("--cuda-graph-mode", "segments").cuda_graph_mode == "segments"
    assert engine("--cuda-graph-mode", "step").cuda_graph_mode == "step"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cuda-graph-mode", "whole"])
    with pytest.raises(ValueError, match="cuda_graph_mode must be one of"):
        EngineConfig(cuda_graph_mode="whole")
    # Off CUDA the step graphs cannot run: the engine says why and keeps the plain steps.
    with caplog.at_level(logging.WARNING, logger="engine.async_engine"):
        cpu = AsyncEngine.from_model(tiny_model, EngineConfig(cuda_graph_mode="step"))
    assert cpu.core.runner.step_graphs is None
    assert "--cuda-graph-mode step runs as segments: CUDA graphs are off" in caplog.text
    assert cpu.core.runner.state.scratch_slot is None
    # The default asks for nothing: off CUDA it keeps the plain steps without a warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.async_engine"):
        default = AsyncEngine.from_model(tiny_model, EngineConfig())
    assert default.core.runner.step_graphs is None
    assert "--cuda-graph-mode step" not in caplog.text


def test_the_default_keep_alive_outlasts_the_clients_idle_expiry():
    # The SDKs' httpx pools drop a connection idle for 5 s; the server must keep it longer, or
    # it closes one as the client sends a request on it (the request fails with no response).
    defaults = config_from_args(build_parser().parse_args([]))
    assert defaults.keep_alive_timeout_s > httpx.Limits().keepalive_expiry
    args = build_parser().parse_args(["--keep-alive-timeout", "90"])
    assert config_from_args(args).keep_alive_timeout_s == 90.0
    with pytest.raises(ValueError, match="keep_alive"):
        ServerConfig(keep_alive_timeout_s=0)
