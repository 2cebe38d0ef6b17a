"""The embedded `default` checkpoint: generated once into a cache folder, reused afterwards."""

from __future__ import annotations

import fcntl
import logging
import time
from pathlib import Path

from engine import envs
from engine.models.deepseek_v41.checkpoint_writer import write_random_checkpoint
from engine.models.deepseek_v41.config import preset_names

EMBEDDED_SEED = 0

logger = logging.getLogger(__name__)


def resolve_model_source(model: str) -> Path | str:
    """A preset name → its embedded checkpoint folder (written once); anything else unchanged
    (a checkpoint folder or hub id for `load_model`)."""
    return ensure_embedded_checkpoint(model) if model in preset_names() else model


def ensure_embedded_checkpoint(preset: str = "default", cache_dir: Path | None = None) -> Path:
    """Path of the preset's random-weight checkpoint, writing it first if it is not there.

    A folder is complete once its `config.json` exists (the writer writes it last), so an
    interrupted generation is redone on the next call.
    """
    folder = (cache_dir or envs.cache_dir()) / f"{preset}-seed{EMBEDDED_SEED}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: processes that start together (the engine ranks of one node) write it once: the
    # first takes the lock and writes, the others wait and find it complete.
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").is_file():
            logger.info(
                "generating the `%s` checkpoint once (random weights) into %s", preset, folder
            )
            started = time.monotonic()
            write_random_checkpoint(preset, folder, seed=EMBEDDED_SEED)
            logger.info("`%s` checkpoint ready in %.0f s", preset, time.monotonic() - started)
    return folder
