"""OpenAI response bodies for chat and text completions, whole and as stream chunks.

Logprobs: the chosen token's string is the engine's share of the output text for that token
(runtime.outputs.TokenLogprob), so a choice's tokens, joined, spell its text and every
`text_offset` points at its token. Among the top alternatives the chosen token reads the same
(so `top_logprobs[i][tokens[i]]` finds it); the others (never in the text) are each token
decoded after a plain one, so a word-start token keeps its leading space. Chat `bytes` are
a token's own bytes: one byte for a byte-fallback token, else the UTF-8 of its string.
"""

from __future__ import annotations

import msgspec

from runtime.outputs import TokenLogprob
from service.api.core.events import TextDelta, ToolArgsDelta, ToolCallStarted
from service.api.core.translator import OutputTranslator, WholeOutput
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
        self.num_top_logprobs = num_top_logprobs  # None: no logprobs asked
        self._sse_head: bytes | None = None
        self._sse_tail = b""
        self._pieces: dict[int, str] = {}  # token id -> its string as a top alternative
        self._anchor: tuple[list[int], int] | None = None  # a plain token and the length of its text

    def alternative_text(self, token_id: int) -> str:
        """How token `token_id` reads after other text (SentencePiece's word-start space kept)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            if self._anchor is None:
                anchor = self.tokenizer.encode("a", add_special_tokens=False)[:1]
                self._anchor = (anchor, len(self.tokenizer.decode(anchor, skip_special_tokens=False)))
            anchor, skip = self._anchor
            piece = self.tokenizer.decode([*anchor, token_id], skip_special_tokens=False)[skip:]
            self._pieces[token_id] = piece
        return piece

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own bytes: a byte-fallback token's one byte (so a character split across
        tokens has its bytes spread over them, and all of them joined are the text's UTF-8), else
        the UTF-8 of its text."""
        raw = self.tokenizer.raw_byte(token_id)
        return [raw] if raw is not None else list(text.encode())

    def _top(self, token: TokenLogprob) -> list[tuple[int, str, float]]:
        """The most probable alternatives as (id, string, logprob), best first; the chosen one as in the text."""
        best = sorted(token.logprobs.items(), key=lambda kv: -kv[1])[: self.num_top_logprobs or 0]
        return [(tid, token.text if tid == token.token_id else self.alternative_text(tid), lp) for tid, lp in best]

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
    """Chat bodies; with a ToolPlan, each choice's output is encoded from its typed output events
    (service/api/core: the tool call parser runs there, once per choice)."""

    api = "chat.completions"

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, tool_plan=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_plan = tool_plan  # service.api.tools.ToolPlan, or None: the text is the content
        self._translator = OutputTranslator(tool_plan)  # used only with a plan
        self._num_calls: dict[int, int] = {}  # choice index -> tool calls started so far, while streaming

    def logprobs(self, tokens: list[TokenLogprob]) -> dict | None:
        if self.num_top_logprobs is None:
            return None
        content = []
        for token in tokens:
            content.append({
                "token": token.text, "logprob": token.logprobs[token.token_id],
                "bytes": self.token_bytes(token.token_id, token.text),
                "top_logprobs": [
                    {"token": text, "logprob": lp, "bytes": self.token_bytes(tid, text)}
                    for tid, text, lp in self._top(token)
                ],
            })
        return {"content": content, "refusal": None}

    def delta_choice(self, index: int, delta: ChoiceDelta, first: bool) -> dict:
        message = {"role": "assistant", "content": delta.text, "refusal": None} if first else {"content": delta.text}
        finish_reason = delta.finish_reason
        if self.tool_plan is not None:
            texts, calls = [], []
            num_calls = self._num_calls.get(index, 0)
            for event in self._translator.events(index, delta):
                if isinstance(event, TextDelta):
                    texts.append(event.text)
                elif isinstance(event, ToolCallStarted):
                    num_calls += 1
                    calls.append({"index": num_calls - 1, "id": event.call_id, "type": "function",
                                  "function": {"name": event.name, "arguments": ""}})
                elif isinstance(event, ToolArgsDelta):
                    calls.append({"index": num_calls - 1, "function": {"arguments": event.arguments}})
                else:
                    finish_reason = event.reason
            self._num_calls[index] = num_calls
            message["content"] = self.tool_plan.shown_content("".join(texts), num_calls)
            if calls:
                message["tool_calls"] = calls
        return {"index": index, "delta": message, "logprobs": self.logprobs(delta.logprobs),
                "finish_reason": finish_reason}

    def final_choice(self, index: int, whole: ChoiceDelta) -> dict:
        message = {"role": "assistant", "content": whole.text, "refusal": None}
        finish_reason = whole.finish_reason
        if self.tool_plan is not None:
            output = WholeOutput(OutputTranslator(self.tool_plan).events(index, whole))
            message["content"] = self.tool_plan.shown_content(output.text, len(output.calls))
            if output.calls:
                message["tool_calls"] = [{"id": call_id, "type": "function",
                                          "function": {"name": name, "arguments": arguments}}
                                         for call_id, name, arguments in output.calls]
            finish_reason = output.finished.reason if output.finished is not None else None
        return {"index": index, "message": message, "logprobs": self.logprobs(whole.logprobs),
                "finish_reason": finish_reason}


class CompletionFormat(ResponseFormat):
    api = "completions"

    """Text completion bodies; with `echo_texts` (one per prompt) each choice's text starts with its prompt."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, echo_texts: list[str] | None = None, n: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # choice index -> characters of its text covered so far
        self.echo_texts = echo_texts
        self.n = n  # choices per prompt: choice index // n is its prompt

    def _echo(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts else ""

    def logprobs(self, index: int, tokens: list[TokenLogprob]) -> dict | None:
        """Choice `index`'s logprobs for these tokens; offsets go on from its earlier chunks."""
        if self.num_top_logprobs is None:
            return None
        offsets, offset = [], self._text_offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token.text)
        self._text_offsets[index] = offset
        return {
            "tokens": [token.text for token in tokens],
            "token_logprobs": [token.logprobs[token.token_id] for token in tokens],
            # as OpenAI: the sampled token is always there, so up to logprobs + 1 entries
            "top_logprobs": [{text: lp for _, text, lp in self._top(token)} | {token.text: token.logprobs[token.token_id]}
                             for token in tokens],
            "text_offset": offsets,
        }

    def delta_choice(self, index: int, delta: ChoiceDelta, first: bool) -> dict:
        text = self._echo(index) + delta.text if first else delta.text
        return {"index": index, "text": text, "logprobs": self.logprobs(index, delta.logprobs),
                "finish_reason": delta.finish_reason}

    def final_choice(self, index: int, whole: ChoiceDelta) -> dict:
        return {"index": index, "text": self._echo(index) + whole.text, "logprobs": self.logprobs(index, whole.logprobs),
                "finish_reason": whole.finish_reason}
