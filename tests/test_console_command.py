"""The README's first command as a user runs it: the installed console command, started from a
directory outside the checkout, imports this project's packages (2026-12-06: transformers 5.25
pulled in Hugging Face's `kernels` distribution, whose top-level `kernels` module shadowed ours in
site-packages, and `.venv/bin/deepinfer-server` failed at import; tests run from the checkout's
root never saw it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]


def _run_outside(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`args` run in `cwd`, without the PYTHONPATH a test runner may have set."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_our_packages_are_the_ones_imported_outside_the_checkout(tmp_path: Path) -> None:
    code = "import engine, kernels, recipe, server; print(kernels.__file__, engine.__file__)"
    result = _run_outside([sys.executable, "-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    kernels_file, engine_file = result.stdout.split()
    assert Path(kernels_file).resolve() == REPO / "kernels" / "__init__.py"
    assert Path(engine_file).resolve() == REPO / "engine" / "__init__.py"


def test_the_console_command_starts_outside_the_checkout(tmp_path: Path) -> None:
    command = Path(sys.executable).parent / "deepinfer-server"
    assert command.exists(), f"no console command beside {sys.executable}: run scripts/setup.sh"
    result = _run_outside([str(command), "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout
