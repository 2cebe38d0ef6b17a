"""The per-request stream loop: a consumer that fell behind gets the queued steps at once."""

from __future__ import annotations

import asyncio

from engine.choices import Choice, stream_choices
from engine.outputs import Delta, TokenLogprob
from engine.request import FinishReason


def _delta(rid: str, index: int, tokens: list[int], total: int, **fields) -> Delta:
    logprobs = [TokenLogprob(t, -0.5) for t in tokens] if fields.pop("logprobs", False) else None
    return Delta(rid, index, tokens, logprobs, 7, total, **fields)


def _stream(choices: tuple[Choice, ...], queued: list[Delta]):
    queue: asyncio.Queue[Delta] = asyncio.Queue()
    for delta in queued:
        queue.put_nowait(delta)
    aborted: list[str] = []
    released: list[bool] = []
    stream = stream_choices(choices, queue, aborted.append, lambda: released.append(True))
    return stream, aborted, released


async def _all(stream) -> list[Delta]:
    return [delta async for delta in stream]


def test_queued_steps_of_a_choice_arrive_as_one_delta() -> None:
    queued = [
        _delta("r", 0, [11], 1, queue_time_s=0.25, num_cached_tokens=128, logprobs=True),
        _delta("r", 0, [12, 13], 3, num_cached_tokens=128, logprobs=True),
        _delta("r", 0, [14], 4, finish_reason=FinishReason.STOP, logprobs=True),
    ]
    stream, aborted, released = _stream((Choice("r", 0, 1),), queued)
    (delta,) = asyncio.run(_all(stream))
    assert delta.token_ids == [11, 12, 13, 14] and delta.num_output_tokens == 4
    assert [entry.token_id for entry in delta.logprobs] == [11, 12, 13, 14]
    assert delta.finish_reason is FinishReason.STOP
    assert delta.queue_time_s == 0.25 and delta.num_cached_tokens == 128
    assert aborted == [] and released == [True]


def test_each_choice_keeps_its_own_tokens_and_an_abort_stays_apart() -> None:
    queued = [
        _delta("r-0", 0, [1], 1),
        _delta("r-1", 1, [5], 1),
        _delta("r-0", 0, [2], 2),
        _delta("r-1", 1, [6], 2, finish_reason=FinishReason.LENGTH),
        _delta("r-0", 0, [], 2, finish_reason=FinishReason.ABORT, error="engine failed"),
    ]
    choices = (Choice("r-0", 0, 1), Choice("r-1", 1, 2))
    stream, aborted, released = _stream(choices, queued)
    deltas = asyncio.run(_all(stream))
    assert [(d.request_id, d.token_ids, d.finish_reason) for d in deltas] == [
        ("r-0", [1, 2], None),  # streamed before the error ends the response
        ("r-1", [5, 6], FinishReason.LENGTH),
        ("r-0", [], FinishReason.ABORT),
    ]
    assert deltas[2].error == "engine failed" and aborted == [] and released == [True]


def test_a_consumer_that_keeps_up_gets_every_step() -> None:
    async def run() -> list[Delta]:
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        stream = stream_choices((Choice("r", 0, 1),), queue, lambda _: None, lambda: None)
        seen = []

        async def engine() -> None:
            for step in range(3):
                await asyncio.sleep(0.01)
                finish = FinishReason.LENGTH if step == 2 else None
                queue.put_nowait(_delta("r", 0, [step], step + 1, finish_reason=finish))

        producer = asyncio.create_task(engine())
        async for delta in stream:
            seen.append(delta)
        await producer
        return seen

    assert [d.token_ids for d in asyncio.run(run())] == [[0], [1], [2]]


def test_leaving_early_aborts_what_is_unfinished() -> None:
    queued = [_delta("r-0", 0, [1], 1), _delta("r-1", 1, [2], 1, finish_reason=FinishReason.STOP)]
    stream, aborted, released = _stream((Choice("r-0", 0, 1), Choice("r-1", 1, 2)), queued)

    async def first_then_leave() -> None:
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(first_then_leave())  # the consumer never saw either choice end
    assert sorted(aborted) == ["r-0", "r-1"] and released == [True]
