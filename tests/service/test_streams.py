"""A slow reader gets merged deltas: memory does not grow per step."""

import asyncio

from runtime.outputs import CompletionOutput, RequestOutput
from service.streams import RequestStream


def _output(step: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index=0, text="", token_ids=[], new_text=f"t{step} ", new_token_ids=[step],
                                  finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], [completion], num_cached_tokens=0, finished=finished)


def test_pending_deltas_merge_until_read():
    async def main():
        stream = RequestStream("r", num_prompt_tokens=2)
        for step in range(100):
            stream.push(_output(step, finished=step == 99), now=float(step))
        assert len(stream._pending) == 1  # one merged delta, not 100 queued ones
        return [d async for d in stream.deltas()]

    batches = asyncio.run(main())
    assert len(batches) == 1
    (delta,) = batches[0]
    assert delta.token_ids == list(range(100)) and delta.text.startswith("t0 t1 ") and delta.finish_reason == "length"


def test_timing_records_first_token_and_gaps():
    async def main():
        stream = RequestStream("r", num_prompt_tokens=2)
        stream.push(_output(0), now=stream.created_at + 0.5)
        stream.push(_output(1), now=stream.created_at + 0.75)
        return stream

    stream = asyncio.run(main())
    assert abs(stream.ttft - 0.5) < 1e-9 and stream.inter_token_latencies == [0.25]
