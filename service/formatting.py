"""OpenAI response bodies for chat and text completions, whole and as stream chunks."""

from __future__ import annotations

import msgspec

from service.streams import ChoiceDelta


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI usage; cached_tokens (input served from shared pages) is a part of prompt_tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseFormat:
    """Shared by both endpoints: ids, timestamps, model, how token ids become strings."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, created: int, model: str, tokenizer, num_top_logprobs: int | None) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.num_top_logprobs = num_top_logprobs
        self._sse_head: bytes | None = None
        self._sse_tail = b""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[: self.num_top_logprobs or 0]

    def sse_event(self, choices: list[dict], include_usage: bool) -> bytes:
        """`data: {chunk}\n\n` for these choices; the constant head and tail are encoded once."""
        if self._sse_head is None:
            head = msgspec.json.encode(self.chunk([], None, include_usage))
            cut = head.index(b'"choices":[]') + len(b'"choices":')
            self._sse_head, self._sse_tail = b"data: " + head[:cut], head[cut + 2 :] + b"\n\n"
        return self._sse_head + msgspec.json.encode(choices) + self._sse_tail

    def chunk(self, choices: list[dict], usage: dict | None = None, include_usage: bool = False) -> dict:
        body = {"id": self.response_id, "object": self.chunk_object_name, "created": self.created,
                "model": self.model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return body

    def response(self, choices: list[dict], usage: dict) -> dict:
        return {"id": self.response_id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict | None:
        if self.num_top_logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, entries):
            text = self.token_text(token_id)
            content.append({
                "token": text, "logprob": entry[token_id], "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := self.token_text(tid)), "logprob": lp, "bytes": list(t.encode())}
                    for tid, lp in self._top(entry)
                ],
            })
        return {"content": content}

    def delta_choice(self, index: int, delta: ChoiceDelta, first: bool) -> dict:
        message = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        return {"index": index, "delta": message, "logprobs": self.logprobs(delta.token_ids, delta.logprobs),
                "finish_reason": delta.finish_reason}

    def role_choice(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def final_choice(self, index: int, text: str, token_ids: list[int], entries, finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(token_ids, entries), "finish_reason": finish_reason}


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]], text_offset: int = 0) -> dict | None:
        if self.num_top_logprobs is None:
            return None
        tokens, offsets, offset = [], [], text_offset
        for token_id in token_ids:
            tokens.append(self.token_text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [entry[t] for t, entry in zip(token_ids, entries)],
            "top_logprobs": [{self.token_text(tid): lp for tid, lp in self._top(entry)} for entry in entries],
            "text_offset": offsets,
        }

    def delta_choice(self, index: int, delta: ChoiceDelta, first: bool) -> dict:
        return {"index": index, "text": delta.text, "logprobs": self.logprobs(delta.token_ids, delta.logprobs),
                "finish_reason": delta.finish_reason}

    def final_choice(self, index: int, text: str, token_ids: list[int], entries, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": self.logprobs(token_ids, entries),
                "finish_reason": finish_reason}
