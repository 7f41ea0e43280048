"""xgrammar vs llguidance on this machine: which grammar engine pagedserve pins (issue 12).

For each engine and each vocabulary (stories260K's 512 tokens; Qwen2's 151,936, rebuilt from
llama.cpp's vocab GGUF), over the 32 schemas of tests/structured/schema_battery.py:
  - tokenizer setup: once per server start;
  - compile: one schema, cold (the engine's own cache off), to its first mask;
  - mask: filling one row's next-token bitmask, and applying it to a float32 logits row
    (each engine's own functions), per generated token, while a noise "model" (seeded random
    logits, argmax) walks each schema to its end;
  - batch: the same for 32 rows at once (one step of a fully constrained batch of 32).
Engines alternate per schema (A B, B A, ...); medians are reported.

    python bench/bench_grammar_engines.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common import STORIES, log, machine_info, median, quick_mode, write_result
from gguf_tokenizer import qwen2_tokenizer_dir

from tests.structured.schema_battery import SCHEMAS

MAX_STEPS = 120


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import xgrammar as xgr
        from tokenizers import Tokenizer

        self.xgr = xgr
        tok = Tokenizer.from_str(tokenizer_json)
        vocab = [""] * vocab_size
        for piece, i in tok.get_vocab(with_added_tokens=True).items():
            vocab[i] = piece
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        self.info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=[eos],
                                      add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        if not matcher.accept_token(token):
            raise RuntimeError("xgrammar refused a token its own mask allowed")
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.llt = llguidance.torch
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(messages[0])
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def apply(self, logits, bitmask) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused a token its own mask allowed: {matcher.get_error()}")
        return matcher.is_stopped()


def walk(engine, compiled, rows: int, seed: int) -> tuple[list[float], list[float]]:
    """Per-step seconds of (mask fill, mask apply) for `rows` matchers of one grammar, walked by noise logits."""
    matchers = [engine.matcher(compiled) for _ in range(rows)]
    done = [False] * rows
    bitmask = engine.bitmask(rows)
    generator = torch.Generator().manual_seed(seed)
    fills, applies, steps = [], [], 0
    while not all(done) and steps < MAX_STEPS:
        logits = torch.randn(rows, engine.vocab_size, generator=generator)  # float32 [rows, vocab]
        start = time.perf_counter()
        for r, m in enumerate(matchers):
            if not done[r]:
                engine.fill(m, bitmask, r)
        filled = time.perf_counter()
        engine.apply(logits, bitmask)
        fills.append(filled - start)
        applies.append(time.perf_counter() - filled)
        tokens = logits.argmax(dim=-1).tolist()
        for r, m in enumerate(matchers):
            if not done[r]:
                done[r] = engine.accept(m, tokens[r])
        steps += 1
    return fills, applies


def measure(vocab_name: str, tokenizer_dir: Path, schemas: dict, batch: int) -> dict:
    tokenizer_json = (tokenizer_dir / "tokenizer.json").read_text()
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id(config["eos_token"] if isinstance(config["eos_token"], str) else config["eos_token"]["content"])
    engines, setup = {}, {}
    for cls in (XGrammar, LLGuidance):
        start = time.perf_counter()
        engines[cls.name] = cls(tokenizer_json, vocab_size, eos)
        setup[cls.name] = time.perf_counter() - start
        log(f"{vocab_name}: {cls.name} tokenizer setup {setup[cls.name]:.2f} s")
    per = {name: {"compile_s": [], "fill_row_s": [], "apply_row_s": [], "fill_batch_s": [], "apply_batch_s": [],
                  "failed": []} for name in engines}
    order = list(engines)
    for i, (schema_name, schema) in enumerate(schemas.items()):
        for name in (order if i % 2 == 0 else order[::-1]):
            engine, out = engines[name], per[name]
            try:
                start = time.perf_counter()  # to the first mask: llguidance builds lazily
                compiled = engine.compile(schema)
                engine.fill(engine.matcher(compiled), engine.bitmask(1), 0)
                out["compile_s"].append(time.perf_counter() - start)
                for rows, key in ((1, "row"), (batch, "batch")):
                    fills, applies = walk(engine, compiled, rows, seed=i)
                    out[f"fill_{key}_s"] += fills
                    out[f"apply_{key}_s"] += applies
            except Exception as exc:  # an engine that cannot handle a schema is a finding, not a crash
                out["failed"].append(f"{schema_name}: {str(exc)[:120]}")
                log(f"{vocab_name}: {name} failed {schema_name}: {str(exc)[:120]}")
        log(f"{vocab_name}: schema {i + 1}/{len(schemas)} {schema_name}")
    summary = {}
    for name, out in per.items():
        summary[name] = {
            "tokenizer_setup_s": setup[name],
            "compile_ms_median": 1e3 * median(out["compile_s"]),
            "compile_ms_max": 1e3 * max(out["compile_s"]),
            "fill_row_us_median": 1e6 * median(out["fill_row_s"]),
            "apply_row_us_median": 1e6 * median(out["apply_row_s"]),
            f"fill_batch{batch}_ms_median": 1e3 * median(out["fill_batch_s"]),
            f"apply_batch{batch}_ms_median": 1e3 * median(out["apply_batch_s"]),
            "schemas_failed": out["failed"],
        }
    return {"vocab": vocab_name, "vocab_size": vocab_size, "engines": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    torch.set_num_threads(1)
    schemas = dict(list(SCHEMAS.items())[:6]) if args.quick else SCHEMAS
    vocabs = [("stories260K", STORIES)]
    try:
        vocabs.append(("qwen2", qwen2_tokenizer_dir()))
    except FileNotFoundError as exc:
        log(f"skipping the Qwen2 vocabulary: {exc}")
    result = {"machine": machine_info(), "batch": 32, "num_schemas": len(schemas),
              "vocabs": [measure(name, path, schemas, 32) for name, path in vocabs]}
    for vocab in result["vocabs"]:
        for name, s in vocab["engines"].items():
            log(f"{vocab['vocab']:>12} {name:>10}: setup {s['tokenizer_setup_s']:.2f} s, compile median "
                f"{s['compile_ms_median']:.2f} ms (max {s['compile_ms_max']:.1f}), row fill {s['fill_row_us_median']:.0f} us "
                f"+ apply {s['apply_row_us_median']:.0f} us, batch32 fill {s['fill_batch32_ms_median']:.2f} ms "
                f"+ apply {s['apply_batch32_ms_median']:.2f} ms, failed {len(s['schemas_failed'])}")
    print(write_result("grammar_engines", args.quick, result))


if __name__ == "__main__":
    main()
