"""Client disconnects for non-streaming requests: cancel the work, which aborts the engine.

`await run_until_disconnect(request, collect())` runs `collect()` and, if the client goes away
first, cancels it: the `engine.generate` iterator inside unwinds (its `finally` aborts the
request and frees its KV) and `ClientDisconnectedError` is raised; the app answers it with an
empty 499 that nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

from server.errors import ClientDisconnectedError

T = TypeVar("T")


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has disconnected.

    NOTE: call only after the body was read (FastAPI reads it before the route runs); after
    that the ASGI `receive` yields nothing but `http.disconnect`.
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`; cancel it and raise `ClientDisconnectedError` if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnectedError("client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
