"""`python -m engine.models`: greedy generation straight on the model, from a preset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_generate_cli_on_the_tiny_preset(tmp_path: Path) -> None:
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.models",
            "--model",
            "tiny",
            "--prompt",
            "tok5 tok6",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    assert "prompt ids: [0, 5, 6]" in out
    generated = out.split("generated ids: ")[1].splitlines()[0]
    assert len(generated.strip("[]").split(",")) == 4
    assert (tmp_path / "tiny-seed0" / "config.json").is_file()  # written once into the cache
