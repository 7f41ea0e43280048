"""What the service asks of a model's tokenizer, a model, an engine, and a bridge (an embedded engine's or Dynamo's)."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from runtime.chat_template import ChatTemplate
from runtime.grammar import CompiledGrammar, GrammarCompiler
from runtime.kv_events import KVEvent
from runtime.outputs import RequestOutput
from runtime.request import Request
from runtime.request_builder import RequestLimits
from runtime.sampling_params import SamplingParams
from service.streams import RequestStream


class Tokenizer(Protocol):
    """What the service asks of the model's tokenizer (runtime.tokenizer)."""

    chat_template: ChatTemplate

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def raw_byte(self, token_id: int) -> int | None: ...
    def token_piece(self, token_id: int) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]: ...


class RequestBuilderLike(Protocol):
    """Request validation (runtime.request_builder.RequestBuilder): safe on the event loop."""

    grammars: GrammarCompiler  # structured outputs, compiled off the loop (service/grammars.py)

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...
    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        cache_salt: str | bytes | None = None, shared_prefix_len: int = 0, pin_id: str | None = None,
                        prompt_param: str = "prompt", grammar: CompiledGrammar | None = None,
                        prediction: str | list[int] | None = None, tenant: str = "default",
                        tenant_weight: float = 1.0, priority: int = 0) -> Request: ...


class ModelLike(Protocol):
    """What the event loop may ask of a model: facts fixed at start, and its request builder.

    The embedded engine (runtime.Engine) or, behind Dynamo, service.distributed.front_door.RemoteModel.
    """

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    block_size: int
    limits: RequestLimits  # the sizes requests are checked against (max_num_seqs sets admission too)
    request_builder: RequestBuilderLike  # validation: the one place requests are built


class EngineLike(ModelLike, Protocol):
    """What the service needs from an engine: runtime.Engine, or bench/stub_engine.py's StubEngine.

    The loop may call only the ModelLike part; everything else runs on the engine thread.
    """

    def add(self, request: Request) -> None: ...
    def abort_request(self, request_id: str) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def unfinished_request_ids(self) -> list[str]: ...
    def stats(self) -> dict: ...
    def record_kv_events(self) -> None: ...
    def take_kv_events(self) -> list[KVEvent]: ...
    def pin_prefix(self, pin_id: str, prompt: str | list[int], cache_salt: str | bytes | None = None,
                   shared_prefix_len: int = 0) -> str: ...
    def unpin_prefix(self, pin_id: str) -> bool: ...
    def page_map(self) -> dict: ...


class Bridge(Protocol):
    """What handlers ask of the engine side: EngineBridge (embedded) or, behind Dynamo, DynamoBridge."""

    streams: dict[str, RequestStream]
    stats: dict  # the latest engine stats snapshot (summed over workers behind Dynamo)

    @property
    def healthy(self) -> bool: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def num_inflight(self) -> int: ...
    @property
    def num_inflight_sequences(self) -> int: ...
    def inflight_sequences_by_tenant(self) -> Counter[str]: ...
    def start(self) -> None: ...
    def submit(self, stream: RequestStream, request: Request) -> None: ...
    def abort(self, request_id: str) -> None: ...
    async def pin(self, pin_id: str, prompt_token_ids: list[int], cache_salt: bytes | None,
                  shared_prefix_len: int = 0) -> int: ...
    async def unpin(self, pin_id: str) -> bool: ...
    async def page_map(self) -> dict: ...
    async def stop(self) -> None: ...
