"""Every environment variable the project reads, declared in one place (read nowhere else)."""

from __future__ import annotations

import os
from pathlib import Path


def nemo_python() -> Path | None:
    """`DEEPINFER_NEMO_PYTHON`: python of the NeMo AutoModel reference venv (parity tests)."""
    value = os.environ.get("DEEPINFER_NEMO_PYTHON")
    return Path(value) if value else None


def cache_dir() -> Path:
    """`DEEPINFER_CACHE_DIR`: where embedded checkpoints are generated (default
    `$XDG_CACHE_HOME/deepinfer` or `~/.cache/deepinfer`)."""
    value = os.environ.get("DEEPINFER_CACHE_DIR")
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deepinfer"


def benchmark_out_dir() -> Path:
    """`OUT`: where benchmark scripts write their JSON (the device tool's result folder;
    default the current folder)."""
    return Path(os.environ.get("OUT", "."))


def torch_distributed() -> dict[str, str]:
    """torch.distributed's own launcher variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    `MASTER_ADDR`, `MASTER_PORT`), those that are set; read by `engine.distributed.groups`."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {name: os.environ[name] for name in names if name in os.environ}


def engine_authkey() -> bytes | None:
    """`DEEPINFER_ENGINE_AUTHKEY`: the secret every node's engine ranks use to authenticate
    their connection to the API process (several nodes only; one node makes its own)."""
    value = os.environ.get("DEEPINFER_ENGINE_AUTHKEY")
    return value.encode() if value else None
