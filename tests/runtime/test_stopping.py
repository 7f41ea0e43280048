"""When a sequence stops: max_tokens, stop strings (across tokens), stop token ids, EOS."""

import pytest

from runtime import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(stories_dir):
    return Engine.from_pretrained(stories_dir, num_blocks=64)


@pytest.fixture(scope="module")
def case(golden):
    return golden["cases"][0]  # "Once upon a time" -> ", there was a little girl named Lily. ..."


def _run(engine, case, **params):
    params = {"max_tokens": 30, "temperature": 0, "ignore_eos": True} | params
    return engine.generate([case["prompt"]], SamplingParams(**params))[0].outputs[0]


def test_max_tokens_finishes_with_length(engine, case):
    out = _run(engine, case, max_tokens=7)
    assert out.token_ids == case["greedy_30_new_ids"][:7] and out.finish_reason == "length"


def test_stop_string_spanning_tokens_is_cut(engine, case):
    out = _run(engine, case, stop=["girl named"])
    assert out.text == ", there was a little "
    assert out.finish_reason == "stop" and out.stop_reason == "girl named"
    kept = _run(engine, case, stop=["girl named"], include_stop_str_in_output=True)
    assert kept.text == ", there was a little girl named"


def test_stop_token_id_ends_the_sequence_and_is_kept_in_ids(engine, case):
    target = case["greedy_30_new_ids"][5]
    out = _run(engine, case, stop_token_ids=[target])
    first = case["greedy_30_new_ids"].index(target)
    assert out.token_ids == case["greedy_30_new_ids"][: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_stops_unless_ignored(stories_dir, case):
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    eos = case["greedy_30_new_ids"][3]
    engine.eos_token_ids = frozenset({eos})
    out = _run(engine, case, ignore_eos=False)
    assert out.token_ids[-1] == eos and out.finish_reason == "stop" and out.stop_reason is None
    assert len(_run(engine, case, ignore_eos=True).token_ids) == 30


def test_streamed_text_never_shows_a_stop_string_prefix(engine, case):
    engine.add_request("s", case["prompt"], SamplingParams(max_tokens=30, temperature=0, stop=["Lily."]))
    pieces = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].new_text)
    assert "".join(pieces) == ", there was a little girl named "
    assert all("Lily" not in p for p in pieces)


def test_the_earliest_of_several_stop_strings_wins(engine, case):
    out = _run(engine, case, stop=["girl", "there"])  # "there" comes first in the text
    assert out.text == ", " and out.stop_reason == "there"


def test_min_tokens_holds_a_stop_id_back_as_transformers_min_new_tokens_does(engine, stories_dir, case):
    """transformers masks its eos_token_id before min_new_tokens: given one of the story's common
    tokens as that id, and the same id as our stop token, both must keep and then end alike."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = case["greedy_30_new_ids"]
    stop_id = ids[3]  # an early output token
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    prompt = engine.tokenizer.encode(case["prompt"])
    for min_tokens in (0, 8, 15):
        out = engine.generate([prompt], SamplingParams(max_tokens=40, min_tokens=min_tokens, temperature=0,
                                                       ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
        with torch.inference_mode():
            want = model.generate(torch.tensor([prompt]), do_sample=False, min_new_tokens=min_tokens,
                                  max_new_tokens=40, eos_token_id=stop_id, pad_token_id=stop_id)[0, len(prompt):]
        want = want.tolist()
        want = want[: want.index(stop_id) + 1] if stop_id in want else want
        assert out.token_ids == want and stop_id not in out.token_ids[:min_tokens]
        assert len(out.token_ids) > min_tokens


def test_min_tokens_holds_stop_strings_back_until_then(engine, case):
    ids = case["greedy_30_new_ids"]
    text = _run(engine, case).text
    stop = text[1:9]  # ends within the first few tokens
    assert _run(engine, case, stop=[stop]).finish_reason == "stop"
    held = _run(engine, case, stop=[stop], min_tokens=12)
    assert held.finish_reason == "length" and held.token_ids == ids  # found only before min_tokens: never ends it


def test_min_tokens_past_max_tokens_is_refused():
    from runtime.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="min_tokens") as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
