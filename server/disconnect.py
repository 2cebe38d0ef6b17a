"""Client disconnects for non-streaming requests: cancel the work, which aborts the engine.

`await run_until_disconnect(request, collect())` runs `collect()` and, if the client goes away
first, cancels it: the `engine.generate` iterator inside unwinds (its `finally` aborts the
request and frees its KV) and `ClientDisconnectedError` is raised; the app answers it with an
empty 499 that nobody reads. If the shutdown drain stops the request first (`server.drain`),
the work is cancelled the same way and the client gets a 503 "the server is shutting down".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

from server.drain import current_stop_event
from server.errors import APIError, ClientDisconnectedError, ErrorKind

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
    """Await `work`; cancel it and raise `ClientDisconnectedError` if the client leaves first,
    or `APIError(UNAVAILABLE)` if the shutdown drain stops the request first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(request))
    stop = current_stop_event()
    stopper = asyncio.create_task(stop.wait()) if stop is not None else None
    try:
        waiters = {task, watcher} if stopper is None else {task, watcher, stopper}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if watcher.done():
            raise ClientDisconnectedError("client disconnected")
        raise APIError(ErrorKind.UNAVAILABLE, "the server is shutting down")
    finally:
        watcher.cancel()
        if stopper is not None:
            stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
