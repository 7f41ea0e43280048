"""DynamoBridge's request path against a scripted Dynamo client and router (no processes).

What the cluster tests cannot force: a worker unreachable before its first frame, a
malformed frame, an abort while the router is still choosing. Every tracked route must be
freed exactly once, and every stream must end.
"""

from __future__ import annotations

import asyncio

import pytest

from config.settings import ROUTING_MODES
from runtime.request import Request
from runtime.sampling_params import SamplingParams
from service.cli import build_parser
from service.distributed import wire
from service.distributed.front_door import DynamoBridge
from service.distributed.routing import ROUTINGS, KvRouting, make_routing
from service.errors import from_exception
from service.streams import RequestStream

import dynamo._core  # noqa: E402,F401  ai-dynamo-runtime, a dev dependency (`make test` installs it): missing fails


class Item:
    def __init__(self, data) -> None:
        self._data = data

    def data(self):
        return self._data


STALL = "stall"  # in a script: the worker goes silent (SIGSTOP, a partition)


async def _frames(script):
    for step in script:
        if isinstance(step, Exception):
            raise step
        if step == STALL:
            await asyncio.sleep(3600)
        await asyncio.sleep(0)
        yield Item(step)


class FakeClient:
    """Dynamo's Client: `scripts[worker]` is what opening a stream to it does (an Exception, or frames)."""

    def __init__(self, scripts: dict[int, object]) -> None:
        self.scripts = scripts
        self.opened: list[int] = []

    def instance_ids(self) -> list[int]:
        return list(self.scripts)

    async def direct(self, call, worker_id, context=None):
        self.opened.append(worker_id)
        script = self.scripts[worker_id]
        if isinstance(script, Exception):
            raise script
        return _frames(script)


class FakeRouter:
    """KvRouter: picks workers in the given order; counts what it tracks and frees."""

    def __init__(self, picks: list[int], hold: asyncio.Event | None = None) -> None:
        self.picks = list(picks)
        self.hold = hold
        self.tracked: list[str] = []
        self.freed: list[str] = []

    async def best_worker(self, token_ids, request_id=None, cache_namespace=None):
        if self.hold is not None:
            await self.hold.wait()
        self.tracked.append(request_id)
        return self.picks.pop(0), 0, 0

    async def mark_prefill_complete(self, request_id):
        pass

    async def free(self, request_id):
        self.freed.append(request_id)


class FakeRuntime:
    def shutdown(self) -> None:
        pass


def _output(text: str) -> dict:
    return wire.encode(wire.Output([wire.Choice(0, text, [5], [], None)], 0))


DONE = wire.encode(wire.Done(16))


def _run(client: FakeClient, router: FakeRouter | None, body, routing: str = "kv", stall_timeout_s: float = 60.0):
    async def main():
        policy = KvRouting(router) if routing == "kv" else make_routing(routing, None, None, 16, 1.0)
        bridge = DynamoBridge(FakeRuntime(), client, policy, asyncio.get_running_loop(), stall_timeout_s)
        request = Request("r1", None, [1, 2, 3], SamplingParams(max_tokens=4), b"salt")
        stream = RequestStream("r1", 3)
        bridge.submit(stream, request)
        await body(bridge, stream)
        await asyncio.wait_for(asyncio.gather(*bridge._tasks), 5)
        return bridge, stream

    return asyncio.run(main())


async def _wait_end(bridge, stream):
    await asyncio.wait_for(_until(lambda: stream.finished), 5)


async def _until(predicate):
    while not predicate():
        await asyncio.sleep(0.001)


def test_an_unreachable_worker_costs_a_new_route_and_every_route_is_freed():
    client = FakeClient({1: Exception("Unavailable: TCP connection failed"), 2: [_output("hi"), DONE]})
    router = FakeRouter([1, 2])
    bridge, stream = _run(client, router, _wait_end)
    assert client.opened == [1, 2]
    assert stream.finished and stream.error is None and stream.num_cached_tokens == 16
    assert [d.text for d in stream.take()] == ["hi"]
    assert router.freed == router.tracked == ["r1", "r1"]
    assert bridge.live_workers() == [2]  # worker 1 is left out until discovery drops it
    assert not bridge.streams


def test_a_worker_lost_after_its_first_frame_fails_the_stream():
    client = FakeClient({1: [_output("a"), Exception("Unavailable: Stream ended before generation completed")]})
    router = FakeRouter([1])
    _, stream = _run(client, router, _wait_end)
    assert stream.finished and "lost" in str(stream.error)
    assert client.opened == [1]  # not sent again: the client already has part of the answer
    assert router.freed == ["r1"]


def test_a_malformed_frame_fails_the_request_without_blaming_the_worker():
    client = FakeClient({1: [{"type": "nonsense"}]})
    router = FakeRouter([1])
    bridge, stream = _run(client, router, _wait_end)
    assert stream.finished and stream.error is not None
    assert client.opened == [1] and bridge.live_workers() == [1]
    assert router.freed == ["r1"]


def test_a_stream_that_ends_without_done_is_routed_again_or_failed():
    client = FakeClient({1: [], 2: [_output("x")]})  # 1 ends at once; 2 ends after a frame, without Done
    router = FakeRouter([1, 2])
    _, stream = _run(client, router, _wait_end)
    assert client.opened == [1, 2]
    assert stream.finished and "lost" in str(stream.error)
    assert router.freed == ["r1", "r1"]


def test_an_abort_while_the_router_chooses_sends_nothing():
    hold = asyncio.Event()
    client = FakeClient({1: [_output("never"), DONE]})

    async def abort_then_release(bridge, stream):
        await asyncio.sleep(0.01)
        bridge.abort("r1")
        hold.set()

    router = FakeRouter([1], hold)
    bridge, stream = _run(client, router, abort_then_release)
    assert client.opened == []
    assert stream.finished and stream.finish_reasons == ["abort"]
    assert router.freed == router.tracked == ["r1"]
    assert not bridge.streams and not bridge._contexts


class BrokenRouter(FakeRouter):
    async def best_worker(self, token_ids, request_id=None, cache_namespace=None):
        raise Exception("no instances of pagedserve/worker/generate")


def test_every_routing_failure_is_a_503_with_retry_after_never_a_500():
    unreachable = Exception("Unavailable: TCP connection failed")
    for client, router in ((FakeClient({1: unreachable, 2: unreachable, 3: unreachable}), FakeRouter([1, 2, 3])),
                           (FakeClient({1: [_output("x")]}), FakeRouter([1])),  # lost after its first frame
                           (FakeClient({1: [_output("x")]}), BrokenRouter([]))):  # the router itself fails
        _, stream = _run(client, router, _wait_end)
        error = from_exception(stream.error)
        assert error.status == 503 and error.headers["Retry-After"], error.body()
        assert error.body()["error"]["code"] == "service_unavailable"


def test_plain_routing_picks_among_live_workers_and_skips_a_lost_one():
    client = FakeClient({1: Exception("Unavailable: TCP connection failed"), 2: [_output("hi"), DONE]})

    async def three_more(bridge, stream):
        await _wait_end(bridge, stream)
        for i in range(3):
            follow = RequestStream(f"r{i + 2}", 3)
            bridge.submit(follow, Request(f"r{i + 2}", None, [1, 2, 3], SamplingParams(max_tokens=4), None))
            await _wait_end(bridge, follow)
            assert follow.error is None

    bridge, stream = _run(client, None, three_more, routing="round_robin")
    assert stream.error is None
    assert client.opened == [2, 1, 2, 2, 2]  # 1 was tried once, then left out


WAITING = wire.encode(wire.Waiting())


def test_a_silent_worker_is_given_up_after_the_stall_timeout_and_waiting_frames_keep_a_slow_one():
    client = FakeClient({1: [WAITING, STALL], 2: [WAITING, WAITING, _output("hi"), DONE]})
    router = FakeRouter([1, 2])
    bridge, stream = _run(client, router, _wait_end, stall_timeout_s=0.2)
    assert client.opened == [1, 2]  # a heartbeat is not a first frame: the stalled request is routed again
    assert stream.error is None and [d.text for d in stream.take()] == ["hi"]
    assert bridge.live_workers() == [2] and router.freed == ["r1", "r1"]
    client = FakeClient({1: [_output("a"), STALL]})
    _, stream = _run(client, FakeRouter([1]), _wait_end, stall_timeout_s=0.2)
    error = from_exception(stream.error)  # part of the answer went out: the request fails, as a 503
    assert error.status == 503 and "sent nothing for 0.2 s" in error.message


def test_routing_policies_are_registered_by_name_as_the_settings_and_the_cli_name_them():
    assert set(ROUTINGS) == set(ROUTING_MODES)
    for name in ("round_robin", "random"):
        assert make_routing(name, None, None, 16, 1.0).name == name
        assert build_parser().parse_args(["serve", "--routing", name]).routing == name
    assert KvRouting(FakeRouter([])).name == "kv"
    with pytest.raises(ValueError, match="'kv', 'round_robin', 'random'"):
        make_routing("nearest", None, None, 16, 1.0)
