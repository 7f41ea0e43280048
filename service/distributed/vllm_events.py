"""A worker's prefix-cache events in vLLM's ZMQ wire format (`--kv-events-endpoint`).

What llm-d's precise prefix scheduler, the Gateway API Inference Extension and Dynamo's ZMQ
relay read from a vLLM server:

    PUB socket, one message per engine step with events, three frames:
        topic (utf-8) | sequence number (8 bytes, big-endian) | msgpack payload
    payload: [ts, [event, ...]]      (an array: vLLM's KVEventBatch is array-like)
    event:   {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
              "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU",
              "lora_name": None, "extra_keys": [(salt,) | None, ...]}
           | {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
           | {"type": "AllBlocksCleared"}
    ROUTER socket (optional) for replays: a request (identity, "", start sequence as 8
    bytes) is answered with every buffered message from that sequence on, each as
    (identity, "", sequence, payload), then (identity, "", -1 as 8 bytes, "").

Block hashes are unsigned 64-bit integers (the first 8 bytes of ours, little-endian),
the form vLLM sends with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES. The tenant's cache salt
rides in `extra_keys` of the first block of its chain, as vLLM puts it there.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import msgspec
import structlog

from runtime.kv_events import BlockRemoved, KVEvent, event_runs
from service.distributed.dynamo_runtime import block_hash_i64

log = structlog.get_logger(__name__)

MEDIUM = "GPU"  # vLLM's name for the device tier; consumers filter on it
REPLAY_BUFFER_STEPS = 10_000
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class StoredEvent(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None


class RemovedEvent(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


class ClearedEvent(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[StoredEvent | RemovedEvent | ClearedEvent]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """The block's 64-bit id (the one Dynamo's events carry), unsigned as vLLM's integer form is."""
    return block_hash_i64(block_hash) & 0xFFFF_FFFF_FFFF_FFFF


def vllm_events(events: list[KVEvent], block_size: int) -> list[StoredEvent | RemovedEvent]:
    """The engine's events in order, one vLLM event per run (runtime.kv_events.event_runs)."""
    out: list[StoredEvent | RemovedEvent] = []
    for run in event_runs(events):
        hashes = [external_hash(event.block_hash) for event in run]
        if isinstance(run[0], BlockRemoved):
            out.append(RemovedEvent(hashes, MEDIUM))
            continue
        parent = external_hash(run[0].parent_hash) if run[0].parent_hash is not None else None
        extra_keys = [(event.salt.hex(),) if event.salt_enters else None for event in run]
        out.append(StoredEvent(hashes, parent, [t for event in run for t in event.token_ids], block_size, None,
                               MEDIUM, None, extra_keys))
    return out


class VllmEventPublisher:
    """PUB (and optional ROUTER replay) sockets on a thread of their own; `publish` only queues."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size: int) -> None:
        import zmq

        self._zmq = zmq
        self.block_size = block_size
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint)
        # the addresses as bound: a port given as * (tcp://127.0.0.1:*) is the one the system chose
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER_STEPS)
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._work, name="kv-events-zmq", daemon=True)
        self._thread.start()
        log.info("publishing vLLM-format KV events", endpoint=self.endpoint, replay=self.replay_endpoint, topic=topic)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (called on the loop); the sockets' thread sends them."""
        batch = vllm_events(events, self.block_size)
        if batch:
            self._queue.put(EventBatch(time.time(), batch))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        self._context.destroy(linger=0)

    def _work(self) -> None:
        while True:
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = ...
            if batch is None:
                return
            if batch is not ...:
                payload = self._encoder.encode(batch)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("malformed KV event replay request", frames=len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))
