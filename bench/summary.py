"""Print the BENCHMARKS.md summary table from bench/results/*.json (run after `make bench`).

    .venv/bin/python bench/summary.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

from common import median, result_path


def load(name: str, quick: bool) -> dict | None:
    path = result_path(name, quick)
    return json.loads(path.read_text()) if path.exists() else None


def _gguf_rows(gguf: dict | None) -> list[tuple[str, str, str, str]]:
    """bench_gguf.py's figures (one file per run of some loads)."""
    out = []
    if not gguf:
        return out
    goals = {"llama.cpp": {"stream1": 1.0, "stream16": 1.5, "stream64": 1.5}, "vllm-bf16": {"stream16": 1.3,
                                                                                         "stream64": 1.3}}
    for name, row in gguf["summary"].items():
        ours = row["median"].get("pagedserve-q4")
        for peer, ratio in row["pagedserve_q4_vs"].items():
            theirs = row["median"][peer]
            goal = goals.get(peer, {}).get(name)
            verdict = "" if goal is None else f": goal >= {goal} {'met' if ratio['output_throughput'] >= goal else 'not met'}"
            out.append((f"SmolLM2-135M Q4_1 GGUF, {name}, pagedserve (Q4 kept) vs {peer}: output tok/s; TPOT p50 (ms)",
                        f"{ours['output_throughput']:.0f}; {ours['median_tpot_ms']:.1f}",
                        f"{theirs['output_throughput']:.0f}; {theirs['median_tpot_ms']:.1f}",
                        f"x{ratio['output_throughput']}; x{ratio['median_tpot']}{verdict}"))
    probes = gguf.get("engine_probes", {})
    if "gguf-q4-auto-dtype" in probes and "folder-float32" in probes:
        q4, f32 = probes["gguf-q4-auto-dtype"], probes["folder-float32"]
        share = q4["weight_mib"] / f32["weight_mib"]
        out.append(("SmolLM2-135M weights in memory, Q4 kept vs float32 (MiB)", f"{q4['weight_mib']}",
                    f"{f32['weight_mib']}", f"{share:.3f} of it: goal <= 0.2 {'met' if share <= 0.2 else 'not met'}"))
        out.append(("SmolLM2-135M perplexity, 2,126-token English text, Q4 kept vs float32",
                    f"{q4['perplexity']}", f"{f32['perplexity']}",
                    f"{q4['perplexity'] / f32['perplexity'] - 1:+.2%}: goal within 1%"))
    return out


SPECULATIVE_GOALS = {"rewrite": 2.5, "prediction": 3.0, "open_chat": 0.97, "streams16": 0.97, "streams64": 0.97,
                     "suffix_open_chat": 0.97, "suffix_streams16": 0.97, "suffix_streams64": 0.97, "repeated_questions": 2.0,
                     "draft_open_chat": 0.97}


def _speculative_rows(spec: dict | None) -> list[tuple[str, str, str, str]]:
    """bench_speculative.py's figures: output tok/s with speculation over without, per dtype and load."""
    out = []
    for dtype, result in (spec or {}).get("dtypes", {}).items():
        for row in result["loads"]:
            goal = SPECULATIVE_GOALS.get(row["load"])
            if goal is None:
                continue
            verdict = "met" if row["ratio"] >= goal else "not met"
            out.append((f"speculative decoding, SmolLM2 Q4 ({result['resolved']}), {row['load']}: output tok/s on vs off "
                        f"(acceptance {row['acceptance_rate']}, tokens identical: {row['identical']})",
                        f"{row['on_tok_s']}", f"{row['off_tok_s']}; goal >= {goal}", f"x{row['ratio']}: {verdict}"))
    return out


def rows(quick: bool) -> list[tuple[str, str, str, str]]:
    """(figure, ours, peer, ratio or verdict)."""
    out = []
    kv = load("kv_memory", quick)
    if kv:
        share = {p["policy"]: p for p in kv["policies"]}
        paged = share["paged-16"]
        for name in ("contiguous-max", "power-of-two", "exact-oracle"):
            p = share[name]
            out.append((f"KV slots holding token states, paged-16 vs {name} (sim.)",
                        f"{paged['token_share_of_reserved_pct']}%", f"{p['token_share_of_reserved_pct']}%",
                        f"mean batch x{round(paged['mean_batch'] / p['mean_batch'], 2)}"))
        for bs in (8, 32):
            p = share[f"paged-{bs}"]
            out.append((f"KV slots holding token states, paged-{bs} (sim.)", f"{p['token_share_of_reserved_pct']}%",
                        "goal >= 97%", "met" if p["token_share_of_reserved_pct"] >= 97 else "not met"))
    engine = load("engine_vs_hf", quick)
    if engine:
        for t in engine["throughput"]:
            s = t["systems"]
            for peer in ("hf-generate", "hf-continuous"):
                out.append((f"output tok/s, {t['model']}, vs {peer}", f"{s['pagedserve']['output_tok_per_s']}",
                            f"{s[peer]['output_tok_per_s']}", f"x{t[f'throughput_ratio_vs_{peer}']}"))
                out.append((f"request latency p50 (s), {t['model']}, vs {peer}", f"{s['pagedserve']['latency_p50_s']}",
                            f"{s[peer]['latency_p50_s']}", f"x{t[f'latency_p50_ratio_vs_{peer}']}"))
    serving = load("serving", quick)
    if serving and "ratios_pagedserve_over_hf" in serving:
        ours, hf = serving["servers"]["pagedserve"], serving["servers"]["hf-serve"]
        for a, b, r in zip(ours, hf, serving["ratios_pagedserve_over_hf"]):
            out.append((f"serving @ {a['rate']} req/s: output tok/s", f"{a['output_throughput']:.0f}",
                        f"{b['output_throughput']:.0f}", f"x{r['output_throughput']}"))
            out.append((f"serving @ {a['rate']} req/s: TTFT p50 / TPOT p50 (ms)",
                        f"{a['ttft_p50_ms']:.0f} / {a['tpot_p50_ms']:.1f}",
                        f"{b['ttft_p50_ms']:.0f} / {b['tpot_p50_ms']:.1f}", f"x{r['ttft_p50']} / x{r['tpot_p50']}"))
    prefix = load("prefix_cache", quick)
    if prefix:
        sb, it = prefix["shared_batch"], prefix["isolated_ttft"]
        on, off = sb["cache_on"], sb["cache_off"]
        out.append(("prefix cache on/off, shared prompts: output tok/s", f"{on['output_tok_per_s']:.1f}",
                    f"{off['output_tok_per_s']:.1f}", f"x{sb['throughput_ratio_on_over_off']}"))
        out.append(("prefix cache on/off, shared prompts: mean TTFT (s), batch", f"{on['ttft_mean_s']:.2f}",
                    f"{off['ttft_mean_s']:.2f}", f"x{sb['ttft_mean_ratio_on_over_off']}"))
        out.append(("prefix cache on/off, shared prompts: TTFT p50 (ms), alone", f"{it['cache_on_ms']:.0f}",
                    f"{it['cache_off_ms']:.0f}", f"x{it['ttft_p50_ratio_on_over_off']}"))
        for zh in prefix["zero_hit"]:
            work = zh["cache_work_pct_on"] - zh["cache_work_pct_off"]
            verdict = "met" if work <= 1 else "not met"
            out.append((f"prefix cache on/off, 0% hits, {zh['model']}: wall time (s); cache's own work",
                        f"{zh['cache_on_s']:.2f}; {work:.2f}% of it", f"{zh['cache_off_s']:.2f}",
                        f"{zh['slowdown_pct']:+}% wall (noise: off runs {zh['spread_off_s'][0]}-"
                        f"{zh['spread_off_s'][1]} s); cache work {verdict} (<= 1%)"))
    parallel = load("parallel_sampling", quick)
    if parallel:
        for r in parallel["rows"]:
            out.append((f"parallel sampling n={r['n']}: peak KV pages, shared vs separate",
                        str(r["shared_peak_blocks"]), str(r["separate_peak_blocks"]), f"{r['saved_pct']}% fewer"))
    overhead = load("overhead", quick)
    if overhead:
        for r in overhead["rows"]:
            out.append((f"engine overhead, {r['model']}, batch {r['batch']}", f"{r['overhead_pct']}% of "
                        f"{r['step_ms']:.1f} ms", "goal < 10%", "met" if r["overhead_pct"] < 10 else "not met"))
    offline = [(f"vllm_offline{m}{d}", model, suffix) for m, model in (("", "23M Llama"), ("_smollm2", "SmolLM2-135M"))
               for d, suffix in (("", ""), ("_bfloat16", ", both bfloat16"))]
    for result, model, suffix in offline:
        for name, row in (load(result, quick) or {}).get("summary", {}).items():
            out.append((f"offline output tok/s vs vLLM {row.get('vllm_version', '0.32.0')} (CPU), {model}, "
                        f"{name} load{suffix}",
                        f"{median(row['pagedserve_tok_per_s']):.0f}", f"{median(row['vllm_tok_per_s']):.0f}",
                        f"x{row['median_ratio']} (tokens equal {row['equal_requests']}/{row['requests']})"))
    for result, model in (("vllm_serving", ""), ("vllm_serving_smollm2", " SmolLM2-135M,")):
        vllm_serving = load(result, quick)
        if not vllm_serving:
            continue
        for name, row in vllm_serving["summary"].items():
            ours, peer = row["median"]["pagedserve"], row["median"]["vllm"]
            load_name, _, rate = name.partition("@")
            rate = rate or "16"  # results from before the rates were a dimension
            out.append((f"vllm bench serve,{model} {load_name}, {rate} req/s: output tok/s; TPOT p50 (ms); TTFT p99 (ms)",
                        f"{ours['output_throughput']:.0f}; {ours['median_tpot_ms']:.0f}; {ours['p99_ttft_ms']:.0f}",
                        f"{peer['output_throughput']:.0f}; {peer['median_tpot_ms']:.0f}; {peer['p99_ttft_ms']:.0f}",
                        f"x{row['output_throughput_ratio']}; x{row['median_tpot_ratio']}; x{row['p99_ttft_ratio']}"))
            if "vs_llama_cpp" in row:
                third, ratio = row["median"]["llama.cpp"], row["vs_llama_cpp"]
                out.append((f"vllm bench serve,{model} {load_name}, {rate} req/s, vs llama.cpp's llama-server (16 slots): same",
                            f"{ours['output_throughput']:.0f}; {ours['median_tpot_ms']:.0f}; {ours['p99_ttft_ms']:.0f}",
                            f"{third['output_throughput']:.0f}; {third['median_tpot_ms']:.0f}; {third['p99_ttft_ms']:.0f}",
                            f"x{ratio['output_throughput_ratio']}; x{ratio['median_tpot_ratio']}; "
                            f"x{ratio['p99_ttft_ratio']}"))
    for gguf_result in ("gguf", "gguf_stream1", "gguf_stream16_stream64_system16"):
        out += _gguf_rows(load(gguf_result, quick))
    out += _speculative_rows(load("speculative", quick))
    attention = load("attention", quick)
    if attention:
        goal = attention["loads"]["goal_64x1024_shared"]
        ms = goal["median_ms"]
        out.append(("decode attention, 64 readers of a 1,024-token prefix + 64 private: cascade vs per-sequence path",
                    f"{ms['cascade']:.2f} ms", f"{ms['per_seq']:.2f} ms",
                    f"x{goal['cascade_vs_per_seq']:.1f}: goal >= 2 {'met' if goal['cascade_vs_per_seq'] >= 2 else 'not met'}"))
        out.append(("decode attention, same load: cascade vs the gather path (reference)",
                    f"{ms['cascade']:.2f} ms", f"{ms['gather']:.2f} ms",
                    f"x{goal['cascade_vs_gather']:.1f}: goal >= 4 {'met' if goal['cascade_vs_gather'] >= 4 else 'not met'}"))
    onednn = load("linear_onednn", quick)
    if onednn:
        speedups = [r["speedup"] for r in onednn["rows"] if r["dtype"] == "float32"]
        out.append(("float32 matmuls of the 23M Llama, oneDNN packed vs F.linear (1-2,048 tokens)",
                    f"x{min(speedups)}-x{max(speedups)}", "F.linear", f"median x{median(speedups)}"))
    service = load("service", quick) or {}
    for run in service.get("overhead_stub_engine", []):
        if run.get("concurrency") == 64:
            met = run["tokens_per_s"] >= 50_000 and run["added_latency_ms_p99"] < 5
            out.append(("service overhead, stub engine, 64 SSE streams: tokens/s; added latency p50 / p99 (ms)",
                        f"{run['tokens_per_s']}; {run['added_latency_ms_p50']} / {run['added_latency_ms_p99']}",
                        "goal >= 50,000; p99 < 5", "met" if met else "not met"))
    durability = service if "durability_real_engine" in service else (load("durability", quick) or {})
    if durability:
        real, stub = durability["durability_real_engine"], durability["durability_stub_engine"]
        on, off = real["median"]["durable"], real["median"]["reply_first"]
        added = real["added_ms"]["last_token_to_done_ms_p99"]
        out.append(("durable billing, real engine, 64 streams: last token -> [DONE] p50 / p99 (ms), vs reply first",
                    f"{on['last_token_to_done_ms_p50']} / {on['last_token_to_done_ms_p99']}",
                    f"{off['last_token_to_done_ms_p50']} / {off['last_token_to_done_ms_p99']}",
                    f"+{added} ms p99: goal < 5 ms {'met' if added < 5 else 'not met'}"))
        out.append(("durable billing, real engine, 64 streams: output tok/s, vs reply first",
                    f"{on['output_tokens_per_s']:.0f}", f"{off['output_tokens_per_s']:.0f}", f"x{real['ratio']}"))
        out.append(("durable billing, stub engine (saturated loop): final message p50 (ms), vs reply first",
                    f"{stub['median']['durable']['sse_final_ms_p50']}", f"{stub['median']['reply_first']['sse_final_ms_p50']}",
                    f"+{stub['added_ms']['sse_final_ms_p50']} ms; requests/s x{stub['requests_per_s_ratio']}"))
    routing = load("routing", quick) or {}
    for rate, result in routing.get("by_rate", {}).items():
        summary = result["summary"]
        for mine, peer in (("kv", "round_robin"), ("kv", "random"), ("kv_x4", "round_robin")):
            if mine not in summary:
                continue
            ours, other = summary[mine], summary[peer]
            name = "KV-aware" if mine == "kv" else "KV-aware (prefill_load_scale 4)"
            out.append((f"3 workers behind Dynamo @ {float(rate):g} req/s, {name} vs {peer}: prefix hit; "
                        "TTFT p50 / p99 (ms); output tok/s",
                        f"{ours['hit_rate']:.0%}; {ours['ttft_p50_s'] * 1000:.0f} / {ours['ttft_p99_s'] * 1000:.0f}; "
                        f"{ours['output_tok_s']:.0f}",
                        f"{other['hit_rate']:.0%}; {other['ttft_p50_s'] * 1000:.0f} / {other['ttft_p99_s'] * 1000:.0f}; "
                        f"{other['output_tok_s']:.0f}",
                        f"x{ours['ttft_p50_s'] / other['ttft_p50_s']:.2f} / x{ours['ttft_p99_s'] / other['ttft_p99_s']:.2f}; "
                        f"x{ours['output_tok_s'] / other['output_tok_s']:.2f}"))
    engines = load("grammar_engines", quick) or {}
    for vocab in engines.get("vocabs", []):
        llg, xgr = vocab["engines"]["llguidance"], vocab["engines"]["xgrammar"]
        out.append((f"grammar engines, {vocab['vocab_size']:,}-token vocabulary: compile to first mask, median / worst "
                    "(ms); one row's mask fill (us), llguidance vs xgrammar",
                    f"{llg['compile_ms_median']:.1f} / {llg['compile_ms_max']:.1f}; {llg['fill_row_us_median']:.0f}",
                    f"{xgr['compile_ms_median']:.1f} / {xgr['compile_ms_max']:.1f}; {xgr['fill_row_us_median']:.0f}",
                    f"x{llg['compile_ms_median'] / xgr['compile_ms_median']:.2f}; "
                    f"x{llg['fill_row_us_median'] / xgr['fill_row_us_median']:.2f}"))
    structured = load("structured", quick) or {}
    for name, entry in structured.get("models", {}).items():
        steps, first = entry["steps"], entry["first_token"]
        out.append((f"batch-32 decode step, every row JSON-constrained vs none, 20M Llama, {name} (ms)",
                    f"{steps['step_ms_all']:.1f}", f"{steps['step_ms_none']:.1f}; goal <= +10%",
                    f"{100 * steps['overhead_all']:+.1f}%: {'met' if steps['overhead_all'] <= 0.10 else 'not met'}"))
        out.append((f"first streamed event, new schema / cached schema vs none, 20M Llama, {name} (ms)",
                    f"{first['first_event_ms_cold']:.1f} / {first['first_event_ms_cached']:.1f}",
                    f"{first['first_event_ms_none']:.1f}",
                    f"{first['added_ms_cold']:+.1f} / {first['added_ms_cached']:+.1f} ms"))
    fleet = load("fleet", quick) or {}
    for key, capacity in fleet.get("capacity_load_under_slo", {}).items():
        workers, policy = key.split("/")
        if policy != "kv":
            continue
        peers = {p: fleet["capacity_load_under_slo"][f"{workers}/{p}"] for p in ("round_robin", "random")}
        ratios = [f"x{capacity / peers[p]:.2f}" if peers[p] else f"{p} over the SLO at every tested load"
                  for p in ("round_robin", "random")]
        out.append((f"fleet simulation, {workers} workers: highest load with TTFT p99 <= "
                    f"{fleet['workload']['ttft_slo_s']:g} s, KV-aware vs round robin / random (sim.)",
                    f"{capacity:g}", f"{peers['round_robin']:g} / {peers['random']:g}", " / ".join(ratios)))
    runs = fleet.get("runs", [])
    if runs:
        largest = max(r["workers"] for r in runs)
        at = {r["policy"]: r for r in runs if r["workers"] == largest and r["load"] == 1.5}
        if len(at) == 3:
            kv, rr, rnd = at["kv"], at["round_robin"], at["random"]
            out.append((f"fleet simulation, {largest} workers at load 1.5: output tok/s; prefix hit, KV-aware vs "
                        "round robin / random (sim.)", f"{kv['output_tok_s']:.0f}; {kv['hit_rate']:.0%}",
                        f"{rr['output_tok_s']:.0f} / {rnd['output_tok_s']:.0f}; {rr['hit_rate']:.0%} / "
                        f"{rnd['hit_rate']:.0%}",
                        f"x{kv['output_tok_s'] / rr['output_tok_s']:.2f} / x{kv['output_tok_s'] / rnd['output_tok_s']:.2f}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    lines = ["| figure | pagedserve | peer / goal | ratio |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows(args.quick)]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
