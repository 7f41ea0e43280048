"""A stand-in engine that emits tokens instantly, to measure the service's own overhead.

Each step gives every running request one token whose text is the time it was made
(`time.perf_counter_ns() // 1000`, microseconds, then a space), so a client on the same
machine can tell how long the token took to reach it.
"""

from __future__ import annotations

import time

from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import InvalidRequestError, SamplingParams
from runtime.tokenizer import ByteTokenizer


class StubEngine:
    model_name = "stub"
    max_model_len = 1 << 20

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.requests: dict[str, list] = {}  # id -> [params, num_prompt, num_emitted, aborted]
        self.num_steps = 0

    def tokenize(self, prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("too long", param="max_tokens", code="context_length_exceeded")

    def add_request(self, request_id, prompt, params, cache_salt=None) -> None:
        self.requests[request_id] = [params, len(prompt), 0, False]

    def abort_request(self, request_id: str) -> bool:
        entry = self.requests.get(request_id)
        if entry is None:
            return False
        entry[3] = True
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        outputs = []
        stamp = f"{time.perf_counter_ns() // 1000} "
        for request_id, entry in list(self.requests.items()):
            params, num_prompt, num_emitted, aborted = entry
            if aborted:
                del self.requests[request_id]
                completion = CompletionOutput(0, "", [], finish_reason="abort")
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
                "prefix_cache_queries": 0, "prefix_cache_hits": 0}
