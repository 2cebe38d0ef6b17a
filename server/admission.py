"""Admission: at most `max_queued_requests` generation requests in the server at once.

A request over the limit is refused at once (never parked), with 429 on OpenAI routes and
529 `overloaded_error` on Messages routes (`APIError(ErrorKind.OVERLOADED)`).

Non-streaming use::

    with admission.admit():
        ...  # generate and build the response

Streaming use (the slot must outlive the route function)::

    slot = admission.acquire()          # raises before any byte is sent
    async def events():
        with slot:                      # released when the stream ends or is cancelled
            async for delta in engine.generate(...):
                yield ...
    return stream_data(events())
"""

from __future__ import annotations

from types import TracebackType

from server.errors import APIError, ErrorKind


class AdmissionSlot:
    """One admitted request; `release()` is idempotent. A context manager that releases."""

    def __init__(self, controller: AdmissionController) -> None:
        self._controller = controller
        self._is_released = False

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._controller._release()

    def __enter__(self) -> AdmissionSlot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class AdmissionController:
    """A non-blocking counting semaphore over in-flight requests (event-loop thread only)."""

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self._num_in_flight = 0

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def is_full(self) -> bool:
        return self._num_in_flight >= self.max_in_flight

    def acquire(self) -> AdmissionSlot:
        """Take a slot, or raise `APIError(OVERLOADED)` when all are taken (mutates)."""
        if self.is_full:
            raise APIError(
                ErrorKind.OVERLOADED,
                f"the server is at capacity ({self.max_in_flight} requests in flight); retry later",
                headers={"retry-after": "1"},
            )
        self._num_in_flight += 1
        return AdmissionSlot(self)

    def admit(self) -> AdmissionSlot:
        """Alias of `acquire` that reads well in a `with` statement."""
        return self.acquire()

    def _release(self) -> None:
        # NOTE: only AdmissionSlot calls this, once per slot, so the count never goes negative.
        self._num_in_flight -= 1
