"""Request timelines (runtime/timeline.py): stamped only when tracing, in order, with the shape of the steps."""

import pytest

from runtime import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(stories_dir):
    return Engine.from_pretrained(stories_dir, num_blocks=64, block_size=16, max_num_batched_tokens=48)


def _run_all(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_without_tracing_no_timeline_is_kept(engine):
    engine.trace_requests = False
    engine.add_request("plain", [1, 5, 9, 13], SamplingParams(max_tokens=2))
    request = engine.requests["plain"]
    _run_all(engine)
    assert request.timeline is None


def test_a_chunked_prompt_is_stamped_at_its_first_chunk_and_at_its_first_token(engine):
    engine.trace_requests = True
    try:
        engine.add_request("short", [1, 7, 8], SamplingParams(max_tokens=3))
        engine.add_request("long", [1] + list(range(3, 103)), SamplingParams(max_tokens=3))  # 101 tokens: 3 chunks of 48
        short, long = engine.requests["short"], engine.requests["long"]
        steps_before = engine.num_steps
        _run_all(engine)
    finally:
        engine.trace_requests = False
    for request in (short, long):
        timeline = request.timeline
        assert timeline.queued_step == steps_before
        assert timeline.queued_at <= timeline.first_scheduled.started_at <= timeline.first_token.started_at
        assert timeline.first_scheduled.duration_s > 0
    # both start in the first step: 3 + 45 of the long prompt's tokens fill the budget of 48
    assert short.timeline.first_scheduled.index == long.timeline.first_scheduled.index == steps_before
    assert short.timeline.first_scheduled.num_seqs == 2 and short.timeline.first_scheduled.num_tokens == 48
    assert short.timeline.first_token is short.timeline.first_scheduled  # a 3-token prompt: one step
    # the long prompt's first token comes from its third chunk: two steps later, a step holding its last 9 tokens
    assert long.timeline.first_token.index == steps_before + 2
    assert long.timeline.first_token.num_decodes == 1  # the short one decoding beside it
    as_dict = long.timeline.as_dict(long.timeline.queued_at)
    assert as_dict["queued_ms"] == 0 and as_dict["num_steps_waited"] == 0
    assert as_dict["first_token"]["index"] == steps_before + 2
