"""POST /tokenize and POST /detokenize (vLLM's), behind the tenant's key like every other route.

    /tokenize    {"prompt": text} or {"messages": [...], "tools"?, "add_generation_prompt"?}
                 -> {"count", "max_model_len", "tokens", "token_strs"?}
                 messages are the prompt a chat completion of them would run (chat template, tools)
    /detokenize  {"tokens": [ids]} -> {"prompt": text}

vLLM leaves these two open when --api-key is set; here a caller needs a tenant's key.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from runtime.json_limits import decode_json
from runtime.sampling_params import InvalidRequestError
from service.api.completions import chat_prompt
from service.api.protocol import ChatCompletionRequest, decode_body
from service.request_lease import RequestLease
from service.state import STATE, ServiceState


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: str | None = None


def _decode(state: ServiceState, raw: bytes, kind: type):
    """The body as `kind`, its model (if named) checked."""
    body = decode_json(raw, type=kind)
    if body.model is not None:
        state.check_model(body.model)
    return body


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize: counted against the tenant's limits (its tokens as any request's), tokenized off the loop."""
    state = request.app[STATE]
    tenant = state.authenticate(request)
    raw = await state.read_body(request)
    async with RequestLease(state, tenant, len(raw)) as lease:
        lease.used_tokens, answer = await state.preprocess(tenant, _tokenize, state, raw)
    return web.Response(body=answer, content_type="application/json")


def _tokenize(state: ServiceState, raw: bytes) -> tuple[int, bytes]:
    """(the count of tokens, the answer as JSON): a megabyte's tokens are encoded here too, not on the loop."""
    body = _decode(state, raw, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give either prompt or messages", param="prompt")
    if body.prompt is not None:
        tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        chat = {"model": state.model_name, "messages": body.messages}
        if body.tools:
            chat["tools"] = body.tools
        if body.chat_template_kwargs is not None:
            chat["chat_template_kwargs"] = body.chat_template_kwargs
        tokens, _, _ = chat_prompt(state, decode_body(chat, ChatCompletionRequest), body.add_generation_prompt)
    answer = {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        answer["token_strs"] = [state.tokenizer.token_piece(t) for t in tokens]  # as vLLM's: the vocabulary's pieces
    return len(tokens), msgspec.json.encode(answer)


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: counted against the tenant's limits like /tokenize."""
    state = request.app[STATE]
    tenant = state.authenticate(request)
    raw = await state.read_body(request)
    async with RequestLease(state, tenant, len(raw)) as lease:
        body, text = await state.preprocess(tenant, _detokenize, state, raw)
        lease.used_tokens = len(body.tokens)
    return web.json_response({"prompt": text})


def _detokenize(state: ServiceState, raw: bytes) -> tuple[DetokenizeRequest, str]:
    body = _decode(state, raw, DetokenizeRequest)
    vocab = state.tokenizer.vocab_size
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise InvalidRequestError(f"token id {token} is outside the vocabulary (0..{vocab - 1})", param=f"tokens[{i}]")
    return body, state.tokenizer.decode(body.tokens)
