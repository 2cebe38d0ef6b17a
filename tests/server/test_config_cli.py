from __future__ import annotations

import pytest

from engine.async_engine import EngineConfig
from server.cli import build_parser, config_from_args, main
from server.config import API_MODEL_NAME, ServerConfig


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
