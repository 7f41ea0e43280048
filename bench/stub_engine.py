"""A stand-in engine that emits tokens instantly, to measure the service's own overhead.

Each step gives every running request one token whose text is the time it was made
(`time.perf_counter_ns() // 1000`, microseconds, then a space), so a client on the same
machine can tell how long the token took to reach it. It answers everything the service's
`EngineLike` protocol asks (service/bridge/protocols.py); it has no pages, so no KV events and no pins.
"""

from __future__ import annotations

import time

from runtime.outputs import CompletionOutput, RequestOutput
from runtime.request import Request
from runtime.request_builder import RequestBuilder, RequestLimits
from runtime.sampling_params import InvalidRequestError, SamplingParams
from runtime.tokenizer import ByteTokenizer


class StubRequestBuilder(RequestBuilder):
    """Checks only what the stub can serve: a non-empty prompt that fits, without a constraint."""

    def prepare_request(self, request_id, prompt, params=None, cache_salt=None, shared_prefix_len=0, pin_id=None,
                        prompt_param="prompt", grammar=None, prediction=None, tenant="default", tenant_weight=1.0,
                        priority=0) -> Request:
        params = params or SamplingParams()
        if params.structured_outputs is not None:
            raise InvalidRequestError("the stub engine does not constrain outputs", param=params.structured_outputs.param)
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        if len(token_ids) + params.max_tokens > self.limits.max_model_len:
            raise InvalidRequestError("too long", param=prompt_param, code="context_length_exceeded")
        return Request(request_id, None, token_ids, params, None)


class StubEngine:
    model_name = "stub"
    max_model_len = 1 << 20
    block_size = 16

    def __init__(self, max_num_seqs: int = 64) -> None:
        self.tokenizer = ByteTokenizer()
        self.limits = RequestLimits(self.tokenizer.vocab_size, self.block_size, self.max_model_len, max_num_seqs,
                                    1 << 20, (self.tokenizer.eos_token_id,))
        self.request_builder = StubRequestBuilder(self.tokenizer, self.limits)
        self.requests: dict[str, list] = {}  # id -> [params, num_prompt, num_emitted, aborted]

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = [request.params, len(request.prompt_token_ids), 0, False]

    def abort_request(self, request_id: str) -> bool:
        entry = self.requests.get(request_id)
        if entry is None:
            return False
        entry[3] = True
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def step(self) -> list[RequestOutput]:
        outputs = []
        stamp = f"{time.perf_counter_ns() // 1000} "
        for request_id, entry in list(self.requests.items()):
            params, num_prompt, num_emitted, aborted = entry
            if aborted or params.max_tokens == 0:
                del self.requests[request_id]
                completion = CompletionOutput(0, "", [], finish_reason="abort" if aborted else "length")
                outputs.append(RequestOutput(request_id, None, [0] * num_prompt, [completion], 0, True))
                continue
            entry[2] = num_emitted = num_emitted + 1
            finished = num_emitted >= params.max_tokens
            completion = CompletionOutput(0, "", [], new_text=stamp, new_token_ids=[65],
                                          finish_reason="length" if finished else None)
            outputs.append(RequestOutput(request_id, None, [0] * num_prompt, [completion], 0, finished))
            if finished:
                del self.requests[request_id]
        return outputs

    def stats(self) -> dict:
        running = len(self.requests)
        return {"block_size": 16, "num_blocks": 1, "num_free_blocks": 1, "num_used_blocks": 0, "num_cached_blocks": 0,
                "num_kv_tokens": 0, "num_running": running, "num_waiting": 0, "num_preemptions": 0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_pinned_blocks": 0}

    def record_kv_events(self) -> None:
        """No pages, so never any events."""

    def take_kv_events(self) -> list:
        return []

    def pin_prefix(self, pin_id, prompt, cache_salt=None, shared_prefix_len=0) -> str:
        raise InvalidRequestError("the stub engine has no pages to pin", param="text", code="pin_budget_exceeded")

    def unpin_prefix(self, pin_id: str) -> bool:
        return False

    def page_map(self) -> dict:
        return {"block_size": 16, "num_blocks": 0, "ref_count": [], "cached": [], "owner": [], "sequences": [],
                "pinned": {}, "num_waiting": 0, "contiguous_max_len_tokens": 0, "stats": self.stats()}
