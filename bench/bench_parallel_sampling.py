"""Parallel sampling: KV pages held with n samples in one request (shared prompt) vs n separate requests.

    .venv/bin/python bench/bench_parallel_sampling.py [--quick]

stories260K, one prompt of `PROMPT_LEN` token ids, `OUTPUT_TOKENS` tokens per sample
(seeded sampling at temperature 0.8, EOS ignored, so every sample has the same length),
16-token pages, prefix caching off in every engine so the only sharing is the fork's:

  shared      one request with SamplingParams(n=n): the samples fork after the prompt and
              share its pages (ref counts; the partial last page is copied on first write)
  separate    n requests with the same prompt and n=1 each, submitted together

For n = 2, 4, 6: the largest `num_used_blocks` (engine.stats()) over the steps, and the
ratio separate / shared. Page counts, not times: the numbers are deterministic. As a
reference, `separate + prefix cache` repeats the separate case with prefix caching on
(the samples then share the prompt's full pages through the cache instead of the fork).
Results: bench/results/parallel_sampling.json.
"""

from __future__ import annotations

import argparse
import random

from common import STORIES, log, machine_info, pin_threads, write_result

from runtime import Engine, SamplingParams  # noqa: E402

PROMPT_LEN = 200
OUTPUT_TOKENS = 120
BLOCK_SIZE = 16


def peak_blocks(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> tuple[int, int]:
    """(peak pages in use, output tokens) while running `requests` together."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    peak, tokens = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
        peak = max(peak, engine.stats()["num_used_blocks"])
    engine.check_invariants()
    return peak, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="same run (it is already short)")
    args = parser.parse_args()
    pin_threads()
    rng = random.Random(8)
    prompt = [1] + [rng.randrange(3, 512) for _ in range(PROMPT_LEN - 1)]
    rows = []
    for n in (2, 4, 6):
        def engine(caching: bool) -> Engine:
            return Engine.from_pretrained(STORIES, block_size=BLOCK_SIZE, num_blocks=1024, max_num_seqs=16,
                                          enable_prefix_caching=caching)

        params = [SamplingParams(n=1, max_tokens=OUTPUT_TOKENS, temperature=0.8, seed=100 + i, ignore_eos=True)
                  for i in range(n)]
        shared, shared_tokens = peak_blocks(engine(False), [("shared", prompt, SamplingParams(
            n=n, max_tokens=OUTPUT_TOKENS, temperature=0.8, seed=100, ignore_eos=True))])
        separate, separate_tokens = peak_blocks(engine(False), [(f"s{i}", prompt, p) for i, p in enumerate(params)])
        cached, _ = peak_blocks(engine(True), [(f"c{i}", prompt, p) for i, p in enumerate(params)])
        if shared_tokens != separate_tokens or shared_tokens != n * OUTPUT_TOKENS:
            raise RuntimeError(f"token counts differ: {shared_tokens} vs {separate_tokens}")
        total = PROMPT_LEN + OUTPUT_TOKENS
        full_prompt_pages = PROMPT_LEN // BLOCK_SIZE
        row = {
            "n": n,
            "shared_peak_blocks": shared,
            "separate_peak_blocks": separate,
            "separate_with_prefix_cache_peak_blocks": cached,
            "ratio_separate_over_shared": round(separate / shared, 2),
            "saved_pct": round(100 * (1 - shared / separate), 1),
            # what the counts should be: each sample's own pages, plus the prompt's full pages once when shared
            "expected_separate": n * -(-(total - 1) // BLOCK_SIZE),
            "expected_shared": full_prompt_pages + n * (-(-(total - 1) // BLOCK_SIZE) - full_prompt_pages),
        }
        rows.append(row)
        log(f"n={n}: {row}")
    result = {
        "machine": machine_info(),
        "model": "stories260K",
        "prompt_tokens": PROMPT_LEN,
        "output_tokens_per_sample": OUTPUT_TOKENS,
        "block_size": BLOCK_SIZE,
        "rows": rows,
    }
    write_result("parallel_sampling", args.quick, result)


if __name__ == "__main__":
    main()
