"""Constrained decoding in the engine, on random-weight checkpoints whose output is noise.

Every output of the 32-schema battery must validate with `jsonschema`: at temperature 0 and
1, n = 1 and 3, cold and on a prefix hit, and in a pool so small that sequences are preempted
and recomputed (their outputs must not change: the matcher stays in step with the tokens).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from runtime.engine import Engine
from runtime.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputs
from tests.structured.schema_battery import SCHEMAS

MAX_TOKENS = 160  # the battery's longest noise output is ~70 tokens
PROMPT = list(range(3, 3 + 45))  # 45 tokens: two full pages to hit in the prefix cache
NAMES = list(SCHEMAS)


def _engine(model_dir, **overrides) -> Engine:
    settings = {"dtype": "float32", "num_blocks": 1024, "max_num_seqs": 128, **overrides}
    return Engine.from_pretrained(model_dir, **settings)


def _battery(engine: Engine, temperature: float, n: int) -> list:
    params = [SamplingParams(n=n, temperature=temperature, seed=17 + i, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputs(json=SCHEMAS[name]))
              for i, name in enumerate(NAMES)]
    return engine.generate([PROMPT] * len(NAMES), params)


def _texts(outputs) -> list[list[str]]:
    return [[c.text for c in output.outputs] for output in outputs]


def _check_valid(outputs) -> None:
    failures = []
    for name, output in zip(NAMES, outputs):
        for sample in output.outputs:
            try:
                if sample.finish_reason != "stop":
                    raise ValueError(f"finish_reason {sample.finish_reason}")
                jsonschema.validate(json.loads(sample.text), SCHEMAS[name])
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append(f"{name}[{sample.index}]: {sample.text!r}: {str(exc)[:100]}")
    assert not failures, failures


@pytest.fixture(scope="module", params=["qwen2", "llama-gqa"])
def model_dir(request, random_checkpoints):
    return random_checkpoints[request.param]


@pytest.mark.parametrize("temperature, n", [(0.0, 1), (0.0, 3), (1.0, 1), (1.0, 3)])
def test_every_schema_validates_cold_and_on_a_prefix_hit(model_dir, temperature, n):
    engine = _engine(model_dir)
    cold = _battery(engine, temperature, n)
    _check_valid(cold)
    hit = _battery(engine, temperature, n)
    _check_valid(hit)
    assert all(output.num_cached_tokens >= 32 for output in hit)  # the prompt's two full pages
    assert _texts(hit) == _texts(cold)  # seeded: a cached prompt does not change the grammar's path
    if n == 3 and temperature > 0:
        assert any(len(set(texts)) > 1 for texts in _texts(cold))  # samples really differ


def test_preempted_sequences_stay_valid_and_unchanged(model_dir):
    roomy = _battery(_engine(model_dir), 1.0, 3)
    small = _engine(model_dir, num_blocks=48)  # 96 sequences of ~7 pages each in 48 pages
    tight = _battery(small, 1.0, 3)
    assert small.scheduler.num_preemptions > 0
    _check_valid(tight)
    assert _texts(tight) == _texts(roomy)
    small.check_invariants()


def test_regex_choice_and_grammars(random_checkpoints):
    engine = _engine(random_checkpoints["qwen2"])
    choices = ['say "yes"', "no\\way", "maybe so"]
    specs = {
        "regex": StructuredOutputs(regex=r"[a-c]{2,4}-[0-9]{1,3}"),
        "choice": StructuredOutputs(choice=choices),
        "lark": StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[xy]/'),
        "gbnf": StructuredOutputs(grammar='root ::= "<" [0-9] [0-9]? ">"'),
    }
    outputs = engine.generate([PROMPT] * len(specs), [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40,
                                                                     structured_outputs=s) for s in specs.values()])
    texts = dict(zip(specs, _texts(outputs)))
    import re

    assert all(re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", t) for t in texts["regex"]), texts["regex"]
    assert all(t in choices for t in texts["choice"]), texts["choice"]
    assert all(re.fullmatch(r"\([xy](,[xy])*\)", t) for t in texts["lark"]), texts["lark"]
    assert all(re.fullmatch(r"<[0-9][0-9]?>", t) for t in texts["gbnf"]), texts["gbnf"]
    assert all(c.finish_reason == "stop" for output in outputs for c in output.outputs)


def test_json_object_is_an_object_and_max_tokens_truncates_with_length(random_checkpoints):
    engine = _engine(random_checkpoints["llama-gqa"])
    spec = StructuredOutputs(json_object=True)
    [whole] = engine.generate([PROMPT], SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                                       structured_outputs=spec))
    ended = [s for s in whole.outputs if s.finish_reason == "stop"]
    assert ended  # some samples close their object
    for sample in ended:
        assert isinstance(json.loads(sample.text), dict)
    for sample in whole.outputs:  # a noise model may nest without end: then the budget ends it, and says so
        assert sample.finish_reason in ("stop", "length") and sample.text.startswith("{")
    schema = SCHEMAS["many_fields"]
    [cut] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5,
                                                     structured_outputs=StructuredOutputs(json=schema)))
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(cut.outputs[0].text)


def test_stop_strings_and_unconstrained_rows_in_the_same_batch(random_checkpoints):
    engine = _engine(random_checkpoints["qwen2"])
    constrained = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                 structured_outputs=StructuredOutputs(json=SCHEMAS["several_fields"]))
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    [alone] = engine.generate([PROMPT], free)
    both = engine.generate([PROMPT, PROMPT], [constrained, free])
    assert both[1].outputs[0].token_ids == alone.outputs[0].token_ids  # the other row's mask never touched it
    text = both[0].outputs[0].text
    stop_at = text[: text.index(",") + 1]
    stopped = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[","],
                             structured_outputs=StructuredOutputs(json=SCHEMAS["several_fields"]))
    [cut] = engine.generate([PROMPT], stopped)
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].text == stop_at[:-1]


def test_abort_frees_a_constrained_request(random_checkpoints):
    engine = _engine(random_checkpoints["qwen2"])
    engine.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=MAX_TOKENS,
                                                   structured_outputs=StructuredOutputs(json=SCHEMAS["many_fields"])))
    for _ in range(3):
        engine.step()
    assert engine.abort_request("r")
    [output] = [o for o in engine.step() if o.request_id == "r"]
    assert output.finished and {c.finish_reason for c in output.outputs} == {"abort"}
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    engine.check_invariants()


def test_the_demo_model_and_its_byte_tokenizer_take_constraints_too():
    engine = Engine.from_pretrained("demo", dtype="float32", num_blocks=64)
    outputs = engine.generate(["x"], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12,
                                                    structured_outputs=StructuredOutputs(regex="[a-f]{3}-[0-9]{2}")))
    import re

    assert all(re.fullmatch("[a-f]{3}-[0-9]{2}", c.text) and c.finish_reason == "stop" for c in outputs[0].outputs)


def test_the_compiler_caches_by_constraint_within_its_bound(random_checkpoints):
    engine = _engine(random_checkpoints["qwen2"])
    compiler = engine.request_builder.grammars
    compiler.cache_size = 4
    first = compiler.compile(StructuredOutputs(json=SCHEMAS["one_string"], param="a"))
    assert compiler.compile(StructuredOutputs(json=json.dumps(SCHEMAS["one_string"]), param="b")) is first
    assert compiler.num_compiled == 1
    for name in NAMES[1:6]:
        compiler.compile(StructuredOutputs(json=SCHEMAS[name]))
    assert len(compiler._cache) == 4 and compiler.cached(StructuredOutputs(json=SCHEMAS["one_string"])) is None


@pytest.mark.parametrize("spec, words", [
    (dict(json={"type": "objekt"}), "objekt"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
    (dict(regex="a(b"), "unclosed"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_a_constraint_that_does_not_compile_names_its_field(random_checkpoints, spec, words):
    engine = _engine(random_checkpoints["qwen2"])
    with pytest.raises(InvalidRequestError) as caught:
        engine.request_builder.prepare_request("r", PROMPT, SamplingParams(structured_outputs=StructuredOutputs(**spec,
                                                                                              param="response_format")))
    assert caught.value.param == "response_format" and words in caught.value.message


def test_a_constraint_is_one_kind():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputs(choice=[])


def test_logit_bias_moves_greedy_choices(random_checkpoints):
    engine = _engine(random_checkpoints["qwen2"])
    [plain] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    banned = plain.outputs[0].token_ids[0]
    forced = 77 if banned != 77 else 78
    [biased] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                        logit_bias={banned: -100, forced: 100}))
    assert biased.outputs[0].token_ids == [forced] * 6
    with pytest.raises(InvalidRequestError) as caught:
        engine.request_builder.prepare_request("r", PROMPT, SamplingParams(logit_bias={10**6: 1.0}))
    assert caught.value.param == "logit_bias"
