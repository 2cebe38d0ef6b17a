"""Run a function on N spawned ranks (torch.multiprocessing, gloo) with a hard deadline.

`run_ranks(fn, world_size, *args)` starts `fn(rank, world_size, port, *args)` in N fresh
processes and returns their results by rank. A rank that raises, exits without a result or
outlives the deadline fails the call; every process still alive is then killed, so no rank is
ever left behind. Every rank's error is reported (a rank's failure makes its peers fail too).
"""

from __future__ import annotations

import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from engine.distributed.groups import free_port

DEADLINE_S = 90.0
GRACE_S = 2.0


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args, results) -> None:
    try:
        results.put((rank, True, fn(rank, world_size, port, *args)))
    except BaseException:  # noqa: BLE001 (reported to the parent, which fails the test)
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, deadline_s: float = DEADLINE_S
) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    errors: list[str] = []
    end = time.monotonic() + deadline_s
    try:
        while len(got) + len(errors) < world_size:
            left = end - time.monotonic()
            if left <= 0:
                if not errors:
                    errors.append(f"timed out after {deadline_s} s; ranks done: {sorted(got)}")
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"a rank died with exit codes {dead}")
                    break
                continue
            if ok:
                got[rank] = value
            else:
                errors.append(f"rank {rank} raised:\n{value}")
                # The others now fail too or wait in a collective: collect what they report
                # for a moment (the first report need not be the cause), then stop them.
                end = min(end, time.monotonic() + GRACE_S)
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
    if errors:
        raise AssertionError("\n".join(errors))
    return [got[rank] for rank in range(world_size)]
