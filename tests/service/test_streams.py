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


def test_the_last_output_is_read_even_when_it_lands_while_the_reader_is_busy():
    # the reader awaits inside its loop (a socket write, a frame sent to the front door); the
    # engine's final output arrives meanwhile: it must still be yielded, not dropped at the end
    async def main():
        stream = RequestStream("r", num_prompt_tokens=2)
        stream.push(_output(0), now=0.0)
        seen = []
        async for deltas in stream.deltas():
            seen += deltas
            if len(seen) == 1:
                await asyncio.sleep(0)
                stream.push(_output(1, finished=True), now=1.0)
                await asyncio.sleep(0)
        return seen

    seen = asyncio.run(main())
    assert [d.token_ids for d in seen] == [[0], [1]] and seen[-1].finish_reason == "length"
