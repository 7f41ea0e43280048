"""OpenAI-compatible HTTP endpoints: chat and text completions (JSON or SSE), models."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from service.errors import APIError, from_exception
from service.api.formatting import ChatFormat, CompletionFormat
from service.api.generation import ChoiceAccumulator, Generation, new_request_id
from service.api.openai_fields import IGNORED_HEADER
from service.api.protocol import ChatCompletionRequest, CompletionRequest, decode_body
from runtime.sampling_params import StructuredOutputs
from service.api.tools import ToolPlan, fallback_system_prompt, plan_tools
from service.request_lease import RequestLease
from service.state import STATE, ServiceState
from service.tenants import Tenant

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


async def chat_generation(state: ServiceState, body: ChatCompletionRequest, tenant: Tenant,
                          request_id: str | None = None, api: str = ChatFormat.api) -> Generation:
    """Validate a chat body and build its Generation (not admitted, not started); `request_id`: the API's own
    id for it (a Responses API `resp_...`), else a chat completion id; `api`: which API asked (Messages and
    Responses run on this chat core too).

    Its tools (service/api/tools.py) go into the prompt and may constrain the output. The prompt is
    rendered and tokenized, the output's grammar compiled and the engine requests validated off the
    event loop (the tenant's line of service/preprocessing.py), before anything is queued.
    """
    prompt, plan, constraint = await state.preprocess(tenant, chat_prompt, state, body)
    grammar = await state.compile_grammar(constraint)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    fmt = ChatFormat(request_id or new_request_id("chatcmpl"), int(time.time()), state.model_name, state.tokenizer, num_top,
                     tool_plan=plan if plan is not None and plan.choice != "none" else None)
    generation = await state.preprocess(tenant, Generation, state, body, [prompt], fmt, tenant, constraint, grammar)
    generation.api = api
    return generation


def chat_prompt(state: ServiceState, body: ChatCompletionRequest, add_generation_prompt: bool = True
                ) -> tuple[list[int], ToolPlan | None, StructuredOutputs | None]:
    """A chat body's prompt (token ids, its tools shown as the template shows them), its tool plan, and the
    output's constraint (the tool plan's, else the body's); validated, nothing compiled."""
    state.check_model(body.model)
    template = state.tokenizer.chat_template
    server = state.settings.server
    requested = body.output_constraint()
    plan = plan_tools(body, template.source, server.tool_call_parser, server.max_tool_calls, requested)
    messages = body.message_dicts()
    described = fallback_system_prompt(plan) if plan is not None and template.is_fallback else None
    if described is not None:  # no template to show the tools: a system message does
        messages = [{"role": "system", "content": described}, *messages]
    prompt = state.tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                 tools=plan.tools if plan is not None else None,
                                                 template_kwargs=body.chat_template_kwargs)
    return prompt, plan, (plan.constraint() if plan is not None else None) or requested


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    tenant = state.authenticate(request)
    raw = await state.read_body(request)
    async with RequestLease(state, tenant, len(raw)) as lease:
        body = await state.preprocess(tenant, decode_body, raw, ChatCompletionRequest)
        return await _respond(request, await chat_generation(state, body, tenant), lease)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    tenant = state.authenticate(request)
    raw = await state.read_body(request)
    async with RequestLease(state, tenant, len(raw)) as lease:
        body, prompts, echo_texts, constraint = await state.preprocess(tenant, _completion_prompts, state, raw)
        grammar = await state.compile_grammar(constraint)
        fmt = CompletionFormat(new_request_id("cmpl"), int(time.time()), state.model_name, state.tokenizer,
                               body.logprobs, echo_texts=echo_texts, n=body.n)  # choices per prompt (best_of keeps n)
        generation = await state.preprocess(tenant, Generation, state, body, prompts, fmt, tenant, constraint, grammar)
        return await _respond(request, generation, lease)


def _completion_prompts(state: ServiceState, raw: bytes):
    """(body, its prompts as token ids, their texts when echoed, the output constraint): a completions
    body parsed and tokenized (on a preprocessing thread)."""
    body = decode_body(raw, CompletionRequest)
    state.check_model(body.model)
    given = body.prompts()
    prompts = [state.engine.request_builder.tokenize(p) for p in given]
    echo_texts = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in given] if body.echo else None
    return body, prompts, echo_texts, body.output_constraint()


async def _respond(request: web.Request, generation: Generation, lease: RequestLease) -> web.StreamResponse:
    await generation.admit(lease)
    try:
        generation.start()
        if generation.body.stream:
            return await _stream_sse(request, generation)
        return await _whole_response(generation)
    finally:
        generation.finish()


async def _whole_response(generation: Generation) -> web.Response:
    acc = ChoiceAccumulator()
    async for deltas in generation.deltas():
        for index, delta in deltas:
            acc.add(index, delta)
    fmt = generation.fmt
    if generation.body.picks_best:
        choices = [fmt.final_choice(whole.index, whole) for whole in acc.best(generation.n, generation.body.n)]
    else:
        choices = [fmt.final_choice(i, whole) for i, whole in sorted(acc.choices.items())]
    await generation.usage_recorded()  # the answer goes out only once its bill is on disk
    return web.Response(body=msgspec.json.encode(fmt.response(choices, generation.usage())), content_type="application/json",
                        headers=_ignored_header(generation))


def _ignored_header(generation: Generation) -> dict[str, str]:
    return {IGNORED_HEADER: ", ".join(generation.ignored_fields)} if generation.ignored_fields else {}


def _event(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def _stream_sse(request: web.Request, generation: Generation) -> web.StreamResponse:
    """data: {chunk} ... [data: {usage chunk}] data: [DONE]; an engine failure sends an error event first.

    One write per wake-up: whatever every choice gained since the last one, merged.
    """
    response = web.StreamResponse(headers={**SSE_HEADERS, **_ignored_header(generation)})
    await response.prepare(request)
    fmt = generation.fmt
    include_usage, continuous = generation.body.include_usage, generation.body.continuous_usage
    started: set[int] = set()
    try:
        async for deltas in generation.deltas():
            choices = [fmt.delta_choice(index, delta, first=index not in started) for index, delta in deltas]
            started.update(index for index, _ in deltas)
            if continuous:  # the usage so far on every chunk
                await response.write(_event(fmt.chunk(choices, generation.usage(), True)))
            else:
                await response.write(fmt.sse_event(choices, include_usage))
    except (ConnectionResetError, ConnectionError):
        return response  # the client left; finish() aborts the engine requests
    except Exception as exc:
        await response.write(_event(from_exception(exc).body()))
    try:
        await generation.usage_recorded()  # the stream's end goes out only once its bill is on disk
    except APIError as exc:  # no usage chunk and no [DONE]: the client sees the answer did not complete
        await response.write(_event(exc.body()))
        await response.write_eof()
        return response
    if include_usage:
        await response.write(_event(fmt.chunk([], generation.usage(), True)))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.authenticate(request)
    card = {"id": state.model_name, "object": "model", "created": int(state.created), "owned_by": "pagedserve",
            "max_model_len": state.engine.max_model_len}
    return web.json_response({"object": "list", "data": [card]})
