"""Speculative decoding on SmolLM2 (its Q4_1 GGUF): output tokens per second with and without drafts.

    .venv/bin/python bench/bench_speculative.py [--quick] [--dtypes float32,auto] [--loads rewrite,...]

One engine without speculation ("off"), one with `ngram` drafts (k = 8, lookup 1..4) and one
with `suffix` drafts (k = 8; vLLM's other suffix defaults), per dtype (float32, and auto: bfloat16 where the CPU has AVX512-BF16 or AMX), both with the
4-bit weights kept. Loads, each run off and on alternately (off on, on off, ...), median of
the repeats; greedy (temperature 0), and the tokens must be identical on both sides:

  rewrite        one stream: "rewrite this text exactly" (the output mostly repeats the input)
  prediction     the same, the engine without a method, each request given the original text
                 as OpenAI's `prediction`
  open_chat      one stream: open questions (little to repeat)
  streams16/64   16 or 64 concurrent streams, mixed prompts (a quarter rewrite, the rest open)
  suffix_*       the same loads with `suffix` drafts. Each run of a suffix load (off and on) is a
                 new tenant (cache salt), so no run drafts from another run's answers, and no
                 prompt is a prefix-cache hit from an earlier run (the loads above repeat the
                 same prompts unsalted, so their later runs hit the cache on both sides), except:
  repeated_questions  one stream; the tenant asked the open questions twice before (untimed), and
                 asks them again: `suffix` drafts from its own past answers (the steady state: a
                 prompt asked again is a prefix-cache hit, as it was the time before)
  repeated_once  the same, asked once before: that first answer was computed without a prefix
                 hit, and where a hit's numerics flip a near-tie, the answer now differs
  questions_twice     one stream, each open question asked twice by a new tenant, both timed
  forced_b*      the rewrite load at 1, 4, 16 and 64 streams with every draft verified (the
                 policy bypassed): where speculation stops paying on this machine
  draft_*        `draft_model` (k = 4): no trained small sibling of SmolLM2 installs here, so the
                 draft is the target's first 6 layers plus its embeddings, final norm and head
                 (bench/smollm2.py cuts the GGUF); rewrite and open chat under the policy, then
                 draft_forced_* with every draft made and verified (the policy bypassed): its cost
  oracle_*       `draft_model` with the target itself as the draft, every draft made: acceptance
                 1 by construction, so the cost of drafting with a model as large as the target

Reported per load: output tok/s off and on (the prompt's prefill included), their ratio, the
same after each request's first token (decode_*: what a streaming reader feels as TPOT), acceptance rate (accepted / drafted),
mean accepted length (1 + accepted per verification, vLLM's), draft tokens per output token.
Results: bench/results/speculative.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

from common import log, machine_info, pin_threads, result_path, write_result

from runtime import Engine, SamplingParams  # noqa: E402
from runtime.speculative import speculator  # noqa: E402
from smollm2 import first_layers_gguf, gguf_file  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
DRAFT_LAYERS = 6  # the draft: SmolLM2's first 6 of 30 layers, its embeddings, final norm and head (Q4_1 as cut)
DRAFT_K = 4
TEXTS = [
    "The committee met on Tuesday to review the budget. After a long discussion, the members agreed to move funds "
    "from the travel account to the training account, and asked the treasurer to report back next month with a "
    "revised plan for the second half of the year.",
    "Our store will be closed on Monday for inventory. Orders placed over the weekend will ship on Tuesday "
    "morning. If you need help before then, please write to the support team and we will answer within one day.",
    "def add_item(cart, item, quantity=1):\n    if quantity <= 0:\n        raise ValueError('quantity must be "
    "positive')\n    cart[item] = cart.get(item, 0) + quantity\n    return cart\n",
    "The river rose slowly through the night. By morning the lower fields were under water, and the farmers moved "
    "their animals to the hill behind the old church, where the ground stays dry even in the worst floods.",
]
OPEN = ["What is the capital of France?", "Give me three tips for sleeping better.", "Why is the sky blue?",
        "Write a short poem about autumn.", "How do I make a cup of tea?", "What are the planets of the solar system?",
        "Explain what a computer virus is.", "Suggest a name for a pet turtle."]


def rewrite_prompt(text: str) -> str:
    return f"Rewrite the following text exactly as it is, without changing anything:\n\n{text}"


def chat(engine: Engine, question: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


_tenants = iter(range(10**9))


def new_tenant() -> str:
    """A cache salt no run has used: what `suffix` remembers of one run never drafts for another."""
    return f"tenant-{next(_tenants)}"


def measure(engine: Engine, prompts: list[list[int]], max_tokens: int, predictions=None, salt=None) -> dict:
    """Run the prompts together once (as tenant `salt`; None: unsalted); tokens, seconds, the speculator's counters."""
    stats = engine.speculator.stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for i, (request_id, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(request_id, prompt, params, prediction=predictions[i] if predictions else None,
                           cache_salt=salt)
    finals = {}
    first_token_at: dict[str, float] = {}
    while len(finals) < len(ids):
        for output in engine.step():
            if output.request_id not in first_token_at and output.outputs[0].new_token_ids:
                first_token_at[output.request_id] = time.perf_counter()
            if output.finished:
                finals[output.request_id] = output
    end = time.perf_counter()
    seconds = end - start
    outputs = [finals[i].outputs[0].token_ids for i in ids]
    drafts = stats.num_drafts - before[0]
    draft_tokens = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    num_tokens = sum(map(len, outputs))
    # after the first token: what streaming users feel (TPOT), the prompt's prefill left out
    decode_seconds = end - max(first_token_at.values())
    return {"tokens": outputs, "num_tokens": num_tokens, "seconds": seconds, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted": accepted, "decode_tokens": num_tokens - len(prompts),
            "decode_seconds": decode_seconds}


def one_stream(engine: Engine, prompts, max_tokens, predictions=None, salt=None, asked_before=0) -> dict:
    """Each prompt alone, in turn (one stream), all as one tenant; totals. `asked_before`: times the tenant
    asked them all already (untimed)."""
    for _ in range(asked_before):
        for p in prompts:
            measure(engine, [p], max_tokens, salt=salt)
    runs = [measure(engine, [p], max_tokens, [predictions[i]] if predictions else None, salt)
            for i, p in enumerate(prompts)]
    total = {k: sum(r[k] for r in runs) for k in ("num_tokens", "seconds", "drafts", "draft_tokens", "accepted",
                                                  "decode_tokens", "decode_seconds")}
    total["tokens"] = [t for r in runs for t in r["tokens"]]
    return total


def compare(name: str, off, on, repeats: int) -> dict:
    """Alternate off and on `repeats` times; medians, ratio, acceptance, identity."""
    rates = {"off": [], "on": []}
    decode_rates = {"off": [], "on": []}
    last = {}
    for r in range(repeats):
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
            result = (off if side == "off" else on)()
            rates[side].append(result["num_tokens"] / result["seconds"])
            decode_rates[side].append(result["decode_tokens"] / result["decode_seconds"])
            last[side] = result
    off_rate, on_rate = statistics.median(rates["off"]), statistics.median(rates["on"])
    off_decode, on_decode = statistics.median(decode_rates["off"]), statistics.median(decode_rates["on"])
    spec = last["on"]
    row = {
        "load": name, "repeats": repeats, "off_tok_s": round(off_rate, 1), "on_tok_s": round(on_rate, 1),
        "ratio": round(on_rate / off_rate, 3), "identical": last["off"]["tokens"] == spec["tokens"],
        "decode_off_tok_s": round(off_decode, 1), "decode_on_tok_s": round(on_decode, 1),
        "decode_ratio": round(on_decode / off_decode, 3),
        "num_output_tokens": spec["num_tokens"], "draft_tokens": spec["draft_tokens"], "accepted": spec["accepted"],
        "acceptance_rate": round(spec["accepted"] / spec["draft_tokens"], 3) if spec["draft_tokens"] else None,
        "mean_accepted_length": round(1 + spec["accepted"] / spec["drafts"], 2) if spec["drafts"] else None,
        "draft_tokens_per_output_token": round(spec["draft_tokens"] / spec["num_tokens"], 3),
        "off_runs": [round(x, 1) for x in rates["off"]], "on_runs": [round(x, 1) for x in rates["on"]],
    }
    log(f"  {name}: off {row['off_tok_s']} tok/s, on {row['on_tok_s']} (x{row['ratio']}; after the first token "
        f"x{row['decode_ratio']}), acceptance "
        f"{row['acceptance_rate']}, mean accepted length {row['mean_accepted_length']}, identical {row['identical']}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat, fewer streams")
    parser.add_argument("--dtypes", default="float32,auto")
    parser.add_argument("--repeats", type=int, default=0, help="alternated repeats per load (default 3; quick 1)")
    parser.add_argument("--draft-depths", default="", help="also cut drafts of these many layers (comma-separated) "
                        "and measure each on open chat with every draft made: acceptance against cost")
    parser.add_argument("--loads", default="", help="only these loads (comma-separated); their rows replace "
                        "the same loads' rows in the results file, the others are kept")
    args = parser.parse_args()
    wanted = set(filter(None, args.loads.split(",")))
    pin_threads()
    repeats = args.repeats or (1 if args.quick else 3)
    path = gguf_file()
    result = {"machine": machine_info(), "model": path.name, "speculative_config": {"ngram": NGRAM, "suffix": SUFFIX},
              "repeats": repeats,
              "dtypes": {}}
    for dtype in args.dtypes.split(","):
        log(f"dtype {dtype}: loading the engines")
        off = Engine.from_pretrained(path, dtype=dtype, num_blocks=2400, max_num_seqs=64)
        on = Engine.from_pretrained(path, dtype=dtype, num_blocks=2400, max_num_seqs=64, speculative_config=NGRAM)
        suffix = Engine.from_pretrained(path, dtype=dtype, num_blocks=2400, max_num_seqs=64,
                                        speculative_config=SUFFIX)
        rewrites = [chat(off, rewrite_prompt(t)) for t in TEXTS]
        opens = [chat(off, q) for q in OPEN]
        for engine in (off, on, suffix):  # untimed warm-up: kernels' first calls, oneDNN primitives
            measure(engine, rewrites[:2] + opens[:2], 16)
        rows = []

        def load(name, off_run, on_run):
            if not wanted or name in wanted:
                rows.append(compare(name, off_run, on_run, repeats))

        load("rewrite", lambda: one_stream(off, rewrites, 160), lambda: one_stream(on, rewrites, 160))
        load("prediction", lambda: one_stream(off, rewrites, 160),
             lambda: one_stream(off, rewrites, 160, predictions=TEXTS))
        load("open_chat", lambda: one_stream(off, opens, 96), lambda: one_stream(on, opens, 96))
        def alone(engine, prompts, max_tokens, **kw):  # one stream, a new tenant
            return lambda: one_stream(engine, prompts, max_tokens, salt=new_tenant(), **kw)

        load("suffix_rewrite", alone(off, rewrites, 160), alone(suffix, rewrites, 160))
        load("suffix_open_chat", alone(off, opens, 96), alone(suffix, opens, 96))
        load("repeated_questions", alone(off, opens, 96, asked_before=2), alone(suffix, opens, 96, asked_before=2))
        load("repeated_once", alone(off, opens, 96, asked_before=1), alone(suffix, opens, 96, asked_before=1))
        twice = [q for q in opens for _ in range(2)]
        load("questions_twice", alone(off, twice, 96), alone(suffix, twice, 96))
        for streams in ((16,) if args.quick else (16, 64)):
            mixed = [(rewrites[i % 4] if i % 4 == 0 else opens[i % len(opens)]) for i in range(streams)]
            load(f"streams{streams}", lambda: measure(off, mixed, 64), lambda: measure(on, mixed, 64))
            load(f"suffix_streams{streams}", lambda: measure(off, mixed, 64, salt=new_tenant()),
                 lambda: measure(suffix, mixed, 64, salt=new_tenant()))
        with every_draft_made():
            for streams in ((1, 16) if args.quick else (1, 4, 16, 64)):
                batch = [rewrites[i % 4] for i in range(streams)]
                load(f"forced_b{streams}", lambda: measure(off, batch, 64), lambda: measure(on, batch, 64))
        draft_info = None
        draft_loads = ("draft_rewrite", "draft_open_chat", "draft_forced_rewrite", "draft_forced_open_chat",
                       "oracle_rewrite", "oracle_open_chat")
        if not wanted or wanted & set(draft_loads):
            draft_config = {"method": "draft_model", "model": str(first_layers_gguf(DRAFT_LAYERS)),
                            "num_speculative_tokens": DRAFT_K}
            drafted = Engine.from_pretrained(path, dtype=dtype, num_blocks=2400, max_num_seqs=64,
                                             speculative_config=draft_config)
            oracle = Engine.from_pretrained(path, dtype=dtype, num_blocks=2400, max_num_seqs=64,
                                            speculative_config={**draft_config, "model": str(path)})
            for engine in (drafted, oracle):
                measure(engine, rewrites[:2] + opens[:2], 16)
            load("draft_rewrite", lambda: one_stream(off, rewrites, 160), lambda: one_stream(drafted, rewrites, 160))
            load("draft_open_chat", lambda: one_stream(off, opens, 96), lambda: one_stream(drafted, opens, 96))
            with every_draft_made():
                load("draft_forced_rewrite", lambda: one_stream(off, rewrites, 160),
                     lambda: one_stream(drafted, rewrites, 160))
                load("draft_forced_open_chat", lambda: one_stream(off, opens, 96),
                     lambda: one_stream(drafted, opens, 96))
                load("oracle_rewrite", lambda: one_stream(off, rewrites, 160), lambda: one_stream(oracle, rewrites, 160))
                load("oracle_open_chat", lambda: one_stream(off, opens, 96), lambda: one_stream(oracle, opens, 96))
            for depth in map(int, filter(None, args.draft_depths.split(","))):
                deeper = Engine.from_pretrained(path, dtype=dtype, num_blocks=2400, max_num_seqs=64, speculative_config={
                    **draft_config, "model": str(first_layers_gguf(depth))})
                one_stream(deeper, opens, 96)  # untimed: its prompts are prefix-cache hits from here on, as off's are
                with every_draft_made():
                    rows.append(compare(f"draft_forced_open_chat_layers{depth}", lambda: one_stream(off, opens, 96),
                                        lambda: one_stream(deeper, opens, 96), 1))
                rows[-1]["relative_cost"] = round(deeper.speculator.proposer.relative_cost, 3)
                del deeper
            method = drafted.speculator.proposer
            if method.seconds_per_draft is not None:  # the cut drafted in this run
                draft_info = {"file": draft_config["model"].rsplit("/", 1)[-1], "layers": DRAFT_LAYERS, "k": DRAFT_K,
                              "relative_cost": round(method.relative_cost, 3),
                              "seconds_per_draft_ms": round(1e3 * method.seconds_per_draft, 2)}
            del drafted, oracle
        for row in rows:
            row.pop("tokens", None)
        result["dtypes"][dtype] = {"resolved": str(off.dtype).removeprefix("torch."), "loads": rows,
                                   "cost_model": [round(x * 1e3, 3) for x in on.speculator.cost.coefficients()],
                                   "draft_model": draft_info}
        del off, on, suffix
    if wanted:
        result = merged(result_path("speculative", args.quick), result)
    write_result("speculative", args.quick, result)


@contextlib.contextmanager
def every_draft_made():
    """The policy bypassed: every sequence verifies all the drafts it is offered (where speculation stops paying)."""
    policy = speculator.plan_drafts
    speculator.plan_drafts = lambda gains, *rest: [len(g) for g in gains]
    try:
        yield
    finally:
        speculator.plan_drafts = policy


def merged(path, result: dict) -> dict:
    """The results file with this run's loads put in (replacing rows of the same load, in the file's order)."""
    if not path.exists():
        return result
    old = json.loads(path.read_text())
    for dtype, fresh in result["dtypes"].items():
        entry = old["dtypes"].setdefault(dtype, {"resolved": fresh["resolved"], "loads": [], "cost_model": None})
        if fresh.get("draft_model"):
            entry["draft_model"] = fresh["draft_model"]
        names = [row["load"] for row in entry["loads"]]
        for row in fresh["loads"]:
            if row["load"] in names:
                entry["loads"][names.index(row["load"])] = row
            else:
                entry["loads"].append(row)
    old["machine"], old["speculative_config"] = result["machine"], result["speculative_config"]
    return old


if __name__ == "__main__":
    main()
