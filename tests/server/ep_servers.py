"""Start `deepinfer-server` as the user does (a subprocess of the CLI) and watch its processes:
the helpers of the live `--ep N` tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 240.0


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def launch(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m server *args`, stdout and stderr into `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=os.getcwd(),
            env={**os.environ, **(env or {})},
        )


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until `/health` answers 200 (fails the test when the server exits or never does)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no startup:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def logged_pids(log: Path, pattern: str = r"engine ranks connected: pids") -> list[int]:
    """The pid list `[a, b]` the log prints after `pattern`."""
    found = re.search(pattern + r" \[([0-9, ]+)\]", log.read_text())
    assert found, log.read_text()[-3000:]
    return [int(p) for p in found.group(1).split(",")]


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (then SIGKILL) a server still running."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
