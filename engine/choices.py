"""The n choices of one user request, shared by every `EngineClient` implementation.

    choices = fan_out(request_id, params)          # engine ids, indexes, seeds
    ... register each choice, hand them to the engine (a thread, a rank) ...
    async for delta in stream_choices(choices, queue, abort, release):
        yield delta

`fan_out` fixes the engine request ids (`{id}` for one choice, `{id}-{i}` for several) and the
seeds (the request's seed, or a random one, spread over the choices), so that a seeded request
samples the same tokens whatever engine runs it. `stream_choices` is the per-request stream
loop: it ends when every choice has finished, and when its consumer leaves early it aborts the
unfinished choices. A consumer that falls behind the engine (steps queue up faster than the
event loop turns them into events) gets the queued steps of a choice as one delta, so the
per-event cost of the API path (events, JSON, socket writes) is paid once per turn of its
loop rather than once per engine step.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from engine.outputs import Delta
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Choice:
    """One engine request of a user request: its id, its choice index and its sampling seed."""

    request_id: str
    index: int
    seed: int


def fan_out(request_id: str, params: SamplingParams) -> tuple[Choice, ...]:
    """The `params.n` engine requests of user request `request_id`.

    One choice keeps the user's id and seed; choice i of several is `{request_id}-{i}` with
    the seed `base + i·φ` (mod 2^63), base being `params.seed` or a random 63-bit seed.
    """
    base = params.seed if params.seed is not None else secrets.randbits(63)
    if params.n == 1:
        return (Choice(request_id, 0, base),)
    return tuple(
        Choice(f"{request_id}-{i}", i, (base + i * _GOLDEN) & _SEED_MASK) for i in range(params.n)
    )


async def stream_choices(
    choices: tuple[Choice, ...],
    deltas: asyncio.Queue[Delta],
    abort: Callable[[str], None],
    release: Callable[[], None],
) -> AsyncIterator[Delta]:
    """Yield the deltas of `choices` from `deltas` until each has had its final delta.

    abort: called with each unfinished choice's id when the consumer leaves early (stops
        iterating, is cancelled, disconnects).
    release: called once at the end, after the aborts, whatever the ending (the caller drops
        its records of the request; late deltas of aborted choices must then be dropped).
    """
    remaining = {choice.request_id for choice in choices}
    try:
        while remaining:
            for delta in _take_queued(await deltas.get(), deltas):
                if delta.finish_reason is not None:
                    remaining.discard(delta.request_id)
                yield delta
    finally:
        for request_id in remaining:
            abort(request_id)
        release()


def _take_queued(first: Delta, deltas: asyncio.Queue[Delta]) -> list[Delta]:
    """`first` and every delta already queued behind it, each choice's run merged into one
    delta (in the order the choices first appear). An abort stays a delta of its own: the
    tokens before it are streamed before its error ends the response."""
    if deltas.empty():
        return [first]
    taken = [first]
    position = {first.request_id: 0}
    while not deltas.empty():
        delta = deltas.get_nowait()
        at = position.get(delta.request_id)
        if at is None or delta.finish_reason is FinishReason.ABORT:
            position[delta.request_id] = len(taken)
            taken.append(delta)
        else:
            taken[at] = merge_deltas(taken[at], delta)
    return taken


def merge_deltas(earlier: Delta, later: Delta) -> Delta:
    """One delta saying what `earlier` then `later` (of the same choice) said: the tokens and
    logprobs of both, the later counts and ending, the earlier queue time and cached tokens."""
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = [*(earlier.logprobs or ()), *(later.logprobs or ())]
    return replace(
        later,
        token_ids=[*earlier.token_ids, *later.token_ids],
        logprobs=logprobs,
        queue_time_s=earlier.queue_time_s
        if earlier.queue_time_s is not None
        else later.queue_time_s,
        num_cached_tokens=earlier.num_cached_tokens,
    )
