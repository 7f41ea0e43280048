"""service/grammars.py: compiles off the loop, once per new constraint however many ask at once."""

import asyncio

import pytest

from runtime.errors import InvalidRequestError
from runtime.grammar import GrammarCompiler
from runtime.structured_outputs import StructuredOutputs
from runtime.tokenizer import HFTokenizer
from service.grammars import LoopCompiles


def test_concurrent_requests_for_a_new_schema_compile_it_once_and_errors_name_each_field(stories_dir):
    tokenizer = HFTokenizer(stories_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    compiles = LoopCompiles(compiler)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    async def main():
        same = await asyncio.gather(*(compiles.compile(StructuredOutputs(json=schema, param=f"p{i}")) for i in range(5)))
        bad = await asyncio.gather(*(compiles.compile(StructuredOutputs(regex="a(b", param=f"q{i}")) for i in range(3)),
                                   return_exceptions=True)
        return same, bad, await compiles.compile(None)

    same, bad, nothing = asyncio.run(main())
    assert all(g is same[0] for g in same) and compiler.num_compiled == 1
    assert [e.param for e in bad] == ["q0", "q1", "q2"] and all(isinstance(e, InvalidRequestError) for e in bad)
    assert nothing is None and compiles._in_flight == {}


def test_the_server_indexes_the_vocabulary_at_start_up(server):
    import time

    deadline = time.monotonic() + 10
    while server.state.engine.request_builder.grammars._llg is None:  # built off the loop by the app's start-up task
        if time.monotonic() > deadline:
            pytest.fail("the vocabulary was not indexed after start-up")
        time.sleep(0.05)
