"""The official openai client, unchanged, against the server (sync and async, stream and not)."""

import asyncio

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["stories260K"]


def test_completion_is_the_greedy_golden_text(client, golden):
    case = golden["cases"][0]
    out = client.completions.create(model="stories260K", prompt=case["prompt"], max_tokens=30, temperature=0,
                                    extra_body={"cache_salt": "golden-once"})  # a cache scope no other test fills
    assert case["prompt"] + out.choices[0].text == case["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(case["prompt_ids"]) and out.usage.completion_tokens == 30
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_completion_equals_the_whole_one(client, golden):
    case = golden["cases"][1]
    chunks = list(client.completions.create(model="stories260K", prompt=case["prompt"], max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert case["prompt"] + text == case["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


def test_token_id_prompts_and_several_prompts(client, golden):
    cases = golden["cases"]
    out = client.completions.create(model="stories260K", prompt=[c["prompt_ids"] for c in cases], max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for case, choice in zip(cases, out.choices):
        assert case["text"].startswith(case["prompt"] + choice.text)
    assert out.usage.prompt_tokens == sum(len(c["prompt_ids"]) for c in cases)


def test_chat_completion_reports_cached_prompt_tokens_on_repeat(client):
    system = "You are a storyteller. " * 12  # well over three 16-token pages
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me about a cat."}]
    first = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=8, temperature=0)
    second = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=8, temperature=0)
    assert first.choices[0].message.role == "assistant"
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= 48
    assert second.usage.prompt_tokens_details.cached_tokens % 16 == 0


def test_chat_stream_with_usage_chunk(client):
    stream = client.chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_n_samples_and_logprobs(client):
    out = client.chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "Once"}], max_tokens=6, n=3, temperature=0.9,
        seed=5, logprobs=True, top_logprobs=2,
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        entries = choice.logprobs.content
        assert len(entries) == 6
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert out.usage.completion_tokens == 18


def test_seeded_requests_repeat(client):
    kwargs = dict(model="stories260K", prompt="The dog", max_tokens=15, temperature=1.0, seed=42)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_stop_string_across_tokens(client, golden):
    case = golden["cases"][0]
    out = client.completions.create(model="stories260K", prompt=case["prompt"], max_tokens=30, temperature=0,
                                    stop=["girl named"])
    assert out.choices[0].text == ", there was a little " and out.choices[0].finish_reason == "stop"


def test_async_client_streams_concurrently(server, golden):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(case):
            stream = await client.completions.create(model="stories260K", prompt=case["prompt"], max_tokens=30,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        texts = await asyncio.gather(*(one(c) for c in golden["cases"] * 4))
        await client.close()
        return texts

    texts = asyncio.run(main())
    for case, text in zip(golden["cases"] * 4, texts):
        assert case["prompt"] + text == case["text"]
    server.wait_idle()
