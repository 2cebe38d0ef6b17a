"""Graceful shutdown: stop admitting, let in-flight requests finish (bounded), stop the rest.

On the first SIGTERM / SIGINT, `DrainingServer` (the uvicorn server `deepinfer-server` runs)
keeps listening and calls `DrainController.drain(timeout)`:

1. draining: every new request gets 503 in its route's envelope with `Connection: close`
   (`/health` answers 503 `{"status": "draining"}`; `/metrics` stays open);
2. in-flight requests get up to `--shutdown-timeout` seconds to finish;
3. stopping: whatever is left is ended: the engine aborts every request, each stream ends with
   its protocol's error event (`server.sse`) and each non-streaming request is answered 503
   (`server.disconnect`); after `STOP_GRACE_S` at most, uvicorn shuts down.

A second signal skips the rest of the drain (uvicorn's own handling; SIGINT twice forces).

Routes learn of the stop through `current_stop_event()` (set per request by
`DrainMiddleware`), so nothing in the routes has to pass it along.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError, ErrorKind, error_response

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # after the stop, how long streams get to send their error events
UNTRACKED_PATHS = frozenset({"/health", "/metrics"})

_controller: contextvars.ContextVar[DrainController | None] = contextvars.ContextVar(
    "drain_controller", default=None
)


def current_stop_event() -> asyncio.Event | None:
    """Set once the request being handled in this context must stop (None outside requests)."""
    controller = _controller.get()
    return None if controller is None else controller.stopped


class DrainController:
    """In-flight request count and the drain state machine: serving -> draining -> stopping.

    abort_all: ends all engine work (called once, when stopping), so that streams waiting
    for their next token wake up and see the stop.
    """

    def __init__(self, abort_all: Callable[[], Awaitable[None]]) -> None:
        self._abort_all = abort_all
        self._num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.is_draining = False
        self.stopped = asyncio.Event()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def enter(self) -> None:
        self._num_in_flight += 1
        self._idle.clear()

    def exit(self) -> None:
        self._num_in_flight -= 1
        if self._num_in_flight == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> None:
        """Run the drain of the module docstring; returns once nothing is in flight or the
        stop's grace ran out (bounded by `timeout + STOP_GRACE_S` plus one engine step)."""
        self.is_draining = True
        logger.info(
            "draining: %d request(s) in flight get up to %.1f s", self._num_in_flight, timeout
        )
        if await _wait(self._idle, timeout):
            logger.info("drained: every in-flight request finished")
            return
        logger.warning(
            "shutdown timeout: stopping %d request(s) still in flight", self._num_in_flight
        )
        self.stopped.set()
        await self._abort_all()
        if not await _wait(self._idle, STOP_GRACE_S):
            logger.warning("%d request(s) did not end after the stop", self._num_in_flight)


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True


class DrainMiddleware:
    """Pure ASGI middleware: refuses requests while draining; counts and marks the others."""

    def __init__(self, app: ASGIApp, controller: DrainController) -> None:
        self.app = app
        self.controller = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path == "/metrics":
            await self.app(scope, receive, send)
            return
        if self.controller.is_draining:
            await _refuse(scope["path"])(scope, receive, send)
            return
        if path in UNTRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        token = _controller.set(self.controller)
        self.controller.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.controller.exit()
            _controller.reset(token)


def _refuse(path: str) -> JSONResponse:
    headers = {"connection": "close"}
    if path == "/health":
        return JSONResponse({"status": "draining"}, status_code=503, headers=headers)
    error = APIError(ErrorKind.UNAVAILABLE, "the server is shutting down", headers=headers)
    return error_response(path, error)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown (first SIGTERM / SIGINT)."""

    def __init__(self, config: uvicorn.Config, controller: DrainController, timeout: float):
        super().__init__(config)
        self._controller = controller
        self._timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_draining = False
        self._drain_task: asyncio.Future[None] | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._is_draining or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._is_draining = True
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        async def drain_then_exit() -> None:
            try:
                await self._controller.drain(self._timeout)
            finally:
                super(DrainingServer, self).handle_exit(sig, None)

        self._drain_task = asyncio.ensure_future(drain_then_exit())
