"""RoutedRequest: outputs reach the HTTP side in order, a stream waits without a Task per token, and the watchdog
gives up with the `stalled` error (cancelling what is left) or lets a dropped request be collected."""

import asyncio
import gc

import pytest

from rollout.engine.core.request import RequestOutput, RequestStatus
from rollout.server import routing
from rollout.server.routing import RoutedRequest


class Paused(Exception):
    pass


def _output(request_id: str, tokens: int, finished: bool = False) -> RequestOutput:
    status = RequestStatus.FINISHED if finished else RequestStatus.DECODING
    return RequestOutput(request_id, [1, 2], generated_tokens=list(range(tokens)), status=status,
                         finish_reason="length" if finished else None)


def _request(loop, cancelled: list, stalled=lambda: None) -> RoutedRequest:
    routed = RoutedRequest(loop, cancel=cancelled.extend, on_final=lambda out: None, stalled=stalled)
    routed.expect("a", 1)
    return routed


def test_a_stream_gets_every_output_in_order_without_a_task_per_token():
    async def main():
        loop = asyncio.get_running_loop()
        created = []
        loop.set_task_factory(lambda lp, coro, **kw: created.append(coro) or asyncio.Task(coro, loop=lp, **kw))
        routed = _request(loop, [])

        async def engine():  # outputs arrive one at a time, as the manager's thread would hand them over
            for i in range(1, 200):
                routed.on_output(_output("a", i))
                await asyncio.sleep(0)
            routed.on_output(_output("a", 200, finished=True))

        producer = asyncio.ensure_future(engine())
        seen = [len(out.generated_tokens) async for _, out in routed]
        await producer
        return seen, len(created)

    seen, tasks = asyncio.run(main())
    assert seen == list(range(1, 201))
    assert tasks <= 2  # the producer (and nothing per token: asyncio.wait_for would add one Task per wait)


def test_a_waiting_stream_gets_the_stalled_error_and_its_sequences_are_cancelled(monkeypatch):
    monkeypatch.setattr(routing, "DISCONNECT_POLL_S", 0.02)

    async def main():
        loop = asyncio.get_running_loop()
        cancelled, state = [], {"paused": False}
        routed = _request(loop, cancelled, stalled=lambda: Paused("paused too long") if state["paused"] else None)
        routed.on_output(_output("a", 1))
        got = []
        with pytest.raises(Paused, match="paused too long"):
            async for _, out in routed:
                got.append(len(out.generated_tokens))
                await asyncio.sleep(0.1)  # several watchdog periods go by with nothing stalled
                state["paused"] = True
        return got, cancelled

    got, cancelled = asyncio.run(main())
    assert got == [1]
    assert cancelled == ["a"]


def test_a_dropped_stream_is_collected_with_its_watchdog_armed_and_cancels_what_is_left(monkeypatch):
    monkeypatch.setattr(routing, "DISCONNECT_POLL_S", 0.02)

    async def main():
        loop = asyncio.get_running_loop()
        cancelled = []
        routed = _request(loop, cancelled)
        routed.on_output(_output("a", 1))
        await routed.__anext__()  # arms the watchdog
        del routed
        gc.collect()
        await asyncio.sleep(0.05)  # the watchdog fires on a dead reference: nothing happens
        return cancelled

    assert asyncio.run(main()) == ["a"]
