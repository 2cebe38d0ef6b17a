"""The embedded `default` checkpoint: generated once into a cache folder, reused afterwards."""

from __future__ import annotations

import os
from pathlib import Path

from engine.models.deepseek_v41.checkpoint_writer import write_random_checkpoint

EMBEDDED_SEED = 0


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/deepinfer` (or `~/.cache/deepinfer`)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deepinfer"


def ensure_embedded_checkpoint(preset: str = "default", cache_dir: Path | None = None) -> Path:
    """Path of the preset's random-weight checkpoint, writing it first if it is not there.

    A folder is complete once its `config.json` exists (the writer writes it last), so an
    interrupted generation is redone on the next call.
    """
    folder = (cache_dir or default_cache_dir()) / f"{preset}-seed{EMBEDDED_SEED}"
    if not (folder / "config.json").is_file():
        write_random_checkpoint(preset, folder, seed=EMBEDDED_SEED)
    return folder
