"""What the loop sends the engine thread through the bridge's inbox (drained between steps)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from runtime.request import Request
from service.streams import RequestStream


@dataclass
class Add:
    stream: RequestStream
    request: Request  # validated by engine.request_builder.prepare_request on the loop


@dataclass
class Pin:
    pin_id: str
    prompt_token_ids: list[int]
    cache_salt: bytes | None
    shared_prefix_len: int
    done: asyncio.Future


@dataclass
class Unpin:
    pin_id: str
    done: asyncio.Future


@dataclass
class PageMap:
    done: asyncio.Future


@dataclass
class Abort:
    request_id: str


STOP = object()


def settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
