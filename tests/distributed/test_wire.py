"""What crosses Dynamo's planes: request/frame round trips, and KV events as Dynamo's publisher inputs."""

from __future__ import annotations

import msgspec
import pytest

from runtime.kv_events import BlockRemoved, BlockStored
from runtime.request import Request
from runtime.sampling_params import InvalidRequestError, SamplingParams
from service.distributed import wire
from service.distributed.dynamo_runtime import block_hash_i64, routing_namespace
from service.distributed.kv_publisher import dynamo_event_batch
from service.streams import ChoiceDelta, RequestStream
from runtime.outputs import TokenLogprob


def _json_round_trip(obj):
    return msgspec.json.decode(msgspec.json.encode(obj))  # what a JSON request plane does to builtins


def test_a_request_crosses_with_its_params_salt_and_shared_blocks():
    params = SamplingParams(n=2, max_tokens=7, temperature=0.5, stop=["x"], logprobs=3, seed=11)
    request = Request("r1", None, [1, 5, 9], params, b"\x00\xffsalt", num_shared_blocks=2)
    call = wire.decode_call(_json_round_trip(wire.encode(wire.generate_call(request))))
    assert isinstance(call, wire.Generate)
    assert (call.request_id, call.prompt_token_ids, call.num_shared_blocks) == ("r1", [1, 5, 9], 2)
    assert wire.salt_bytes(call.cache_salt) == b"\x00\xffsalt"
    assert wire.params_of(call) == params


def test_bad_params_from_the_wire_are_refused_as_they_are_built():
    call = wire.Generate("r", [1], {"n": 0}, None, 0)
    with pytest.raises((InvalidRequestError, msgspec.ValidationError)):
        wire.params_of(call)


def test_a_frame_becomes_the_output_a_stream_merges():
    delta = ChoiceDelta(1)
    delta.text, delta.token_ids, delta.finish_reason = "hi", [7, 8], "length"
    delta.logprobs = [TokenLogprob(7, "h", {7: -0.5, 3: -1.5}), TokenLogprob(8, "i", {8: -0.25})]
    frame = wire.decode_frame(_json_round_trip(wire.encode(wire.Output([wire.choice_of(delta)], 32))))
    stream = RequestStream("r", 40, n=2)
    stream.push(wire.request_output("r", [0] * 40, frame, finished=False), 0.0)
    stream.push(wire.request_output("r", [0] * 40, wire.Done(32), finished=True), 0.1)
    (merged,) = stream.take()
    assert (merged.index, merged.text, merged.token_ids, merged.finish_reason) == (1, "hi", [7, 8], "length")
    assert [(lp.token_id, lp.text, lp.logprobs) for lp in merged.logprobs] == [(7, "h", {7: -0.5, 3: -1.5}),
                                                                               (8, "i", {8: -0.25})]
    assert stream.finished and stream.num_cached_tokens == 32 and stream.num_completion_tokens == [0, 2]


def test_kv_events_become_dynamo_publisher_inputs_one_per_chain():
    h = [bytes([i]) * 32 for i in range(5)]
    salt = b"\x01\x02"
    events = [
        BlockStored(h[0], None, (1,) * 4, None), BlockStored(h[1], h[0], (2,) * 4, salt, salt_enters=True),
        BlockStored(h[2], h[1], (3,) * 4, salt),  # shared block, then two of the tenant's
        BlockRemoved(h[3]), BlockRemoved(h[4]),
        BlockStored(h[3], h[2], (4,) * 4, salt),
    ]
    batch = dynamo_event_batch(events, block_size=4)
    assert [e["type"] for e in batch] == ["stored", "stored", "removed", "stored"]
    shared, tenant, removed, later = batch
    assert shared == {"type": "stored", "token_ids": [1] * 4, "num_block_tokens": [4],
                      "block_hashes": [block_hash_i64(h[0])]}  # no parent, no salt
    assert tenant["cache_salt"] == salt.hex() and tenant["parent_hash"] == block_hash_i64(h[0])
    assert tenant["token_ids"] == [2] * 4 + [3] * 4 and tenant["num_block_tokens"] == [4, 4]
    assert removed["block_hashes"] == [block_hash_i64(h[3]), block_hash_i64(h[4])]
    assert later["parent_hash"] == block_hash_i64(h[2])  # after a removal, a new event that names its parent
    assert all(-(2**63) <= x < 2**63 for e in batch for x in e["block_hashes"])


def test_a_request_with_a_shared_prefix_is_routed_unsalted():
    assert routing_namespace(b"\xab", 0) == "ab"
    assert routing_namespace(b"\xab", 3) is None  # the shared blocks are hashed without a salt
    assert routing_namespace(None, 0) is None


def test_a_quiet_request_on_the_worker_sends_heartbeats_between_its_items():
    import asyncio

    from service.distributed.worker import _with_heartbeats

    async def slow():
        await asyncio.sleep(0.35)
        yield "a"
        yield "b"

    async def collect():
        return [item async for item in _with_heartbeats(slow(), 0.1)]

    got = asyncio.run(collect())
    assert got[-2:] == ["a", "b"] and set(got[:-2]) == {None} and 2 <= len(got) - 2 <= 4
    assert msgspec.convert(wire.encode(wire.Waiting()), wire.Frame) == wire.Waiting()


def test_a_request_carries_its_tenant_weight_and_priority_to_the_worker():
    request = Request("r2", None, [1, 2, 3], SamplingParams(max_tokens=2), b"\x01", tenant="acme", tenant_weight=3.0,
                      priority=-1)
    call = wire.decode_call(_json_round_trip(wire.encode(wire.generate_call(request))))
    assert (call.tenant, call.tenant_weight, call.priority) == ("acme", 3.0, -1)  # each worker is fair on its own
