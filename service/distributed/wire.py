"""What crosses Dynamo's request plane between a front door and a worker.

Dynamo carries JSON-like Python objects, so each message is a msgspec Struct turned into
builtins (`encode`) and back (`decode_call`, `decode_frame`), tagged by its `type` field.

    front door -> worker      Generate | Pin | Unpin | Describe | Stats | PageMap
    worker -> front door      Output* (what the request's stream gained since the last frame:
                              one step's news, or several steps' merged), then Done; or Failure;
                              Reply for the one-shot calls
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.outputs import CompletionOutput, RequestOutput, TokenLogprob
from runtime.request import Request
from runtime.sampling_params import InvalidRequestError, SamplingParams
from service.streams import ChoiceDelta


class Generate(msgspec.Struct, tag="generate"):
    """Run one request; the worker streams its Output frames."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' fields
    cache_salt: str | None  # hex of the tenant salt
    num_shared_blocks: int  # leading blocks hashed without the salt (an operator-shared prefix)
    prediction_token_ids: list[int] = []  # Predicted Outputs, tokenized by the front door: the worker drafts from it
    tenant: str = "default"  # fair scheduling's party on the worker (each worker is fair on its own)
    tenant_weight: float = 1.0
    priority: int = 0


class Pin(msgspec.Struct, tag="pin"):
    pin_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    shared_prefix_len: int


class Unpin(msgspec.Struct, tag="unpin"):
    pin_id: str


class Describe(msgspec.Struct, tag="describe"):
    """The worker's model name and request limits (RequestLimits' fields)."""


class Stats(msgspec.Struct, tag="stats"):
    """The worker's latest engine stats snapshot."""


class PageMap(msgspec.Struct, tag="page_map"):
    """engine.page_map(), for the dashboard."""


Call = Generate | Pin | Unpin | Describe | Stats | PageMap


class Choice(msgspec.Struct, array_like=True):
    """One sample's news since the last frame (a ChoiceDelta)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, str, list[tuple[int, float]]]]  # (token id, its text, [(id, logprob), ...])
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


class Output(msgspec.Struct, tag="output"):
    choices: list[Choice]
    num_cached_tokens: int
    num_accepted_prediction_tokens: int = 0
    num_cache_written_tokens: int = 0


class Done(msgspec.Struct, tag="done"):
    """The request ended on the worker (every choice has its finish reason)."""

    num_cached_tokens: int
    num_accepted_prediction_tokens: int = 0
    num_cache_written_tokens: int = 0


class Failure(msgspec.Struct, tag="failure"):
    """The call failed: `invalid` for a caller's error (InvalidRequestError), else the worker's."""

    message: str
    invalid: bool = False
    param: str | None = None
    code: str | None = None


class Reply(msgspec.Struct, tag="reply"):
    value: Any


class Waiting(msgspec.Struct, tag="waiting"):
    """A heartbeat: the request is alive on the worker but has no news (queued, or in a long prefill).

    A front door that hears nothing from a worker for distributed.worker_timeout_s gives the
    request up as lost; these keep a live but slow request from looking like a stalled worker.
    """


Frame = Output | Done | Failure | Reply | Waiting


def failure_error(frame: Failure) -> Exception:
    """The exception a Failure frame stands for: the caller's InvalidRequestError, or the worker's RuntimeError."""
    if frame.invalid:
        return InvalidRequestError(frame.message, frame.param, frame.code)
    return RuntimeError(frame.message)


def failure_of(exc: InvalidRequestError) -> Failure:
    """A caller's error as the Failure frame that carries it back."""
    return Failure(exc.message, invalid=True, param=exc.param, code=exc.code)


def encode(message: msgspec.Struct) -> dict:
    """A message as the builtins Dynamo's request plane carries."""
    return msgspec.to_builtins(message)


def decode_call(obj: Any) -> Call:
    """A call from the request plane; raises msgspec.ValidationError on a malformed one."""
    return msgspec.convert(obj, Call)


def decode_frame(obj: Any) -> Frame:
    """A frame from the request plane; raises msgspec.ValidationError on a malformed one."""
    return msgspec.convert(obj, Frame)


def generate_call(request: Request) -> Generate:
    """The wire form of a request built by RequestBuilder.prepare_request."""
    return Generate(request.request_id, request.prompt_token_ids, msgspec.to_builtins(request.params),
                    salt_hex(request.cache_salt), request.num_shared_blocks, request.prediction_token_ids,
                    request.tenant, request.tenant_weight, request.priority)


def salt_hex(salt: bytes | None) -> str | None:
    return salt.hex() if salt is not None else None


def salt_bytes(salt: str | None) -> bytes | None:
    return bytes.fromhex(salt) if salt is not None else None


def params_of(call: Generate) -> SamplingParams:
    """The call's SamplingParams (checked again as they are built; logit_bias keys may arrive as strings)."""
    return msgspec.convert(call.params, SamplingParams, str_keys=True)


def choice_of(delta: ChoiceDelta) -> Choice:
    logprobs = [(lp.token_id, lp.text, list(lp.logprobs.items())) for lp in delta.logprobs]
    return Choice(delta.index, delta.text, delta.token_ids, logprobs, delta.finish_reason, delta.stop_reason)


def request_output(request_id: str, prompt_token_ids: list[int], frame: Output | Done, finished: bool) -> RequestOutput:
    """A frame as the RequestOutput a RequestStream merges (deltas only: new_text, new_token_ids)."""
    outputs = []
    if isinstance(frame, Output):
        for choice in frame.choices:
            logprobs = [TokenLogprob(token_id, text, dict(top)) for token_id, text, top in choice.logprobs] or None
            outputs.append(CompletionOutput(index=choice.index, text="", token_ids=[], new_text=choice.text,
                                            new_token_ids=choice.token_ids, finish_reason=choice.finish_reason,
                                            stop_reason=choice.stop_reason, new_logprobs=logprobs))
    return RequestOutput(request_id, None, prompt_token_ids, outputs, frame.num_cached_tokens, finished,
                         num_accepted_prediction_tokens=frame.num_accepted_prediction_tokens,
                         num_cache_written_tokens=frame.num_cache_written_tokens)
