"""vLLM-format KV events (`--kv-events-endpoint`), read back by decoders nobody here wrote.

Dynamo's ZMQ relay (KvEventPublisher with zmq_endpoint) subscribes to vLLM's wire format and
feeds Dynamo's indexer: if it places our blocks and drops them again, the format is right.
The replay socket is checked with a plain ZMQ DEALER, as a subscriber that joined late uses it.
"""

from __future__ import annotations

import asyncio
import random
import time

import msgspec

from runtime import Engine, SamplingParams
from runtime.kv_events import BlockRemoved, BlockStored
from service.distributed.vllm_events import END_OF_REPLAY, VllmEventPublisher, external_hash, vllm_events

import dynamo._core as core  # noqa: E402  a dev dependency (`make test` installs it): missing fails
import zmq  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 512) for _ in range(n - 1)]


async def _wait_for(fetch, predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = await fetch()
        if predicate(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)


def test_dynamos_zmq_relay_places_and_drops_our_blocks(stories_dir, tmp_path, monkeypatch):
    from service.distributed.dynamo_runtime import create_runtime

    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "discovery"))  # create_runtime sets these for the process:
    monkeypatch.setenv("DYN_LOG", "warn")  # set them through monkeypatch so they are undone afterwards
    for name in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST"):
        monkeypatch.setenv(name, "127.0.0.1")

    engine = Engine.from_pretrained(stories_dir, num_blocks=8, pinned_block_budget=0)
    engine.record_kv_events()
    prompt = _tokens(56, seed=1)  # three full pages of 16

    async def main() -> tuple[int, int]:
        runtime = create_runtime(asyncio.get_running_loop(), tmp_path / "discovery")
        endpoint = runtime.endpoint("relaytest.worker.generate")

        async def handler(request, context):
            yield {}

        serving = asyncio.ensure_future(endpoint.serve_endpoint(handler))
        await core.register_model(core.ModelInput.Tokens, core.ModelType.Completions, endpoint, "m", "m",
                                  worker_type=core.WorkerType.Aggregated, kv_cache_block_size=16,
                                  skip_model_assets=True)
        ours = VllmEventPublisher("tcp://127.0.0.1:*", None, "kv", engine.block_size)  # the port it bound
        relay = core.KvEventPublisher(endpoint, kv_block_size=16, zmq_endpoint=ours.endpoint, zmq_topic="kv")
        router = core.KvRouter(endpoint, 16, core.KvRouterConfig())
        await asyncio.sleep(1.0)  # the relay's SUB connects (PUB drops what comes before)

        async def device_blocks() -> int:
            scores = await router.get_overlap_scores(prompt)
            return max((w["device_blocks"] for w in scores["workers"]), default=0)

        try:
            engine.generate([prompt], ONE)
            ours.publish(engine.take_kv_events())
            placed = await _wait_for(device_blocks, lambda n: n == 3)
            engine.generate([_tokens(120, seed=2)], ONE)  # needs every page: evicts the first prompt's
            events = engine.take_kv_events()
            assert any(isinstance(e, BlockRemoved) for e in events)
            ours.publish(events)
            dropped = await _wait_for(device_blocks, lambda n: n == 0)
            return placed, dropped
        finally:
            relay.shutdown()
            ours.close()
            serving.cancel()
            runtime.shutdown()

    placed, dropped = asyncio.run(main())
    assert placed == 3
    assert dropped == 0


def test_stored_blocks_of_one_chain_merge_and_carry_the_salt_where_it_enters():
    h = [bytes([i]) * 32 for i in range(4)]
    events = [BlockStored(h[0], None, (1, 2), None), BlockStored(h[1], h[0], (3, 4), b"\x07", salt_enters=True),
              BlockStored(h[2], h[1], (5, 6), b"\x07"), BlockRemoved(h[3]), BlockStored(h[3], h[0], (9, 9), None)]
    out = vllm_events(events, block_size=2)
    assert [type(e).__name__ for e in out] == ["StoredEvent", "StoredEvent", "RemovedEvent", "StoredEvent"]
    shared, salted, _, later = out
    assert shared.block_hashes == [external_hash(h[0])] and shared.parent_block_hash is None
    assert salted.block_hashes == [external_hash(x) for x in h[1:3]] and salted.token_ids == [3, 4, 5, 6]
    assert salted.parent_block_hash == external_hash(h[0]) and salted.extra_keys == [("07",), None]
    assert later.parent_block_hash == external_hash(h[0])  # a new chain from an older parent: its own event


def test_the_replay_socket_returns_every_batch_from_the_asked_sequence():
    publisher = VllmEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "kv", 16)  # ports bound, then read
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        for i in range(3):
            publisher.publish([BlockRemoved(bytes([i]) * 32)])
        time.sleep(0.3)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[1] == END_OF_REPLAY:
                break
    finally:
        dealer.close(0)
        context.term()
        publisher.close()
    assert [int.from_bytes(f[1], "big", signed=True) for f in replies] == [1, 2, -1]
    decoded = msgspec.msgpack.decode(replies[0][2])  # [ts, [event], dp rank]: an array, events tagged by "type"
    assert isinstance(decoded[0], float)
    assert decoded[1] == [{"type": "BlockRemoved", "block_hashes": [external_hash(bytes([1]) * 32)], "medium": "GPU"}]
