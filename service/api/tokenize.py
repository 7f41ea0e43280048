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

from runtime.sampling_params import InvalidRequestError
from service.api.completions import chat_prompt
from service.api.protocol import ChatCompletionRequest, decode_body
from service.state import STATE


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


async def _body(request: web.Request, kind: type):
    """(state, the body as `kind`) once the caller's key and the body's model (if named) are checked."""
    state = request.app[STATE]
    state.authenticate(request)
    body = msgspec.json.decode(await request.read(), type=kind, strict=True)
    if body.model is not None:
        state.check_model(body.model)
    return state, body


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize."""
    state, body = await _body(request, TokenizeRequest)
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
    return web.json_response(answer)


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize."""
    state, body = await _body(request, DetokenizeRequest)
    vocab = state.tokenizer.vocab_size
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise InvalidRequestError(f"token id {token} is outside the vocabulary (0..{vocab - 1})", param=f"tokens[{i}]")
    return web.json_response({"prompt": state.tokenizer.decode(body.tokens)})
