"""The `pagedserve` command: `generate` (one prompt), `serve` (the API), `worker` (a Dynamo worker)."""

from __future__ import annotations

import argparse
import os
import sys

from config.settings import ROUTING_MODES, SCHEDULING_NAMES, TOOL_CALL_PARSERS
from service.logs import configure_logging

MODEL_HELP = "Hugging Face checkpoint folder, a GGUF file (llama.cpp's format), or 'demo' (random weights)"
DTYPE_HELP = "float32, bfloat16, float16, or auto (bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16)"
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
QUANTIZATION_HELP = ("matmul weights: auto (a GGUF's quantized types keep their own groups where a CPU kernel runs "
                     "them, others dense), none (dense), int8 (per row) or int4 (per 32 inputs) at load")
SPECULATIVE_HELP = ("speculative decoding, as vLLM's JSON: "
                    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'; "
                    "the output is the same as without it")


def _generate(args: argparse.Namespace) -> int:
    from config import ConfigError
    from runtime import Engine, InvalidRequestError, SamplingParams
    from runtime.model.config import UnsupportedModelError

    try:
        engine = Engine.from_pretrained(
            args.model, show_progress=True, settings_file=args.config, device=args.device, dtype=args.dtype,
            num_blocks=args.num_blocks, quantization=args.quantization, speculative_config=args.speculative_config,
        )
    except (UnsupportedModelError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=args.stop or [], stop_token_ids=args.stop_token_id or [],
        )
        engine.add_request("cli", args.prompt, params)
    except InvalidRequestError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    while engine.has_unfinished_requests():
        for output in engine.step():
            out.write(output.outputs[0].new_text)
            out.flush()
            if output.finished:
                finish_reason = output.outputs[0].finish_reason
    out.write("\n")
    print(f"[{len(output.outputs[0].token_ids)} tokens, finish_reason={finish_reason}]", file=sys.stderr)
    return 0


def _settings(args: argparse.Namespace):
    """Settings from --config, the environment and the flags; None (after one line on stderr) if invalid."""
    from config import ConfigError, load_settings, parse_speculative_config

    server = {"model": args.model, "host": args.host, "served_model_name": args.served_model_name}
    distributed = {"discovery_dir": args.discovery_dir, "namespace": args.namespace}
    if args.command == "serve":
        server["port"] = args.port
        server.update(tenants_file=args.tenants, redis_url=args.redis_url, data_dir=args.data_dir,
                      tool_call_parser=args.tool_call_parser)
        distributed.update(router=args.router, routing=args.routing)
    else:  # a worker's port is its own setting: its default (0, a free port) never collides with serve's 8000
        distributed.update(worker_port=args.port, kv_events_endpoint=args.kv_events_endpoint,
                           kv_events_replay_endpoint=args.kv_events_replay_endpoint)
    try:
        return load_settings(args.config, overrides={
            "server": server,
            "engine": {"device": args.device, "dtype": args.dtype, "num_blocks": args.num_blocks,
                       "max_num_seqs": args.max_num_seqs, "quantization": args.quantization,
                       "scheduling": args.scheduling,
                       "speculative_config": parse_speculative_config(args.speculative_config)},
            "distributed": distributed,
        })
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    from service.server import run

    return _run_with_settings(args, run)


def _worker(args: argparse.Namespace) -> int:
    from service.distributed.worker import run_worker

    return _run_with_settings(args, run_worker)


def _run_with_settings(args: argparse.Namespace, main) -> int:
    """Load the settings, set up logging, run `main(settings)`; 2 if the settings are invalid."""
    settings = _settings(args)
    if settings is None:
        return 2
    configure_logging(args.log_level or settings.server.log_level, settings.server.log_json)
    main(settings)
    return 0


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None,
                        help="serve: the API port (default 8000); worker: its probe port (default: a free one, printed)")
    parser.add_argument("--config", help="TOML settings file (see config/default.toml)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help=DTYPE_HELP)
    parser.add_argument("--quantization", choices=QUANTIZATION_MODES, default=None, help=QUANTIZATION_HELP)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--speculative-config", default=None, help=SPECULATIVE_HELP)
    parser.add_argument("--scheduling", choices=SCHEDULING_NAMES, default=None,
                        help="who starts next: fair (per-tenant virtual token counters, weighted by each plan's "
                             "weight; the default) or fcfs (arrival order)")
    parser.add_argument("--discovery-dir", default=None,
                        help="Dynamo file discovery folder, shared by the front doors and workers of one cluster")
    parser.add_argument("--namespace", default=None, help="Dynamo namespace (default: pagedserve)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with a paged KV cache")
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="demo", help=MODEL_HELP)
    gen.add_argument("--config", help="TOML settings file (see config/default.toml)")
    gen.add_argument("--device", default=None)
    gen.add_argument("--dtype", default=None, help=DTYPE_HELP)
    gen.add_argument("--quantization", choices=QUANTIZATION_MODES, default=None, help=QUANTIZATION_HELP)
    gen.add_argument("--num-blocks", type=int, default=None)
    gen.add_argument("--speculative-config", default=None, help=SPECULATIVE_HELP)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", type=int, action="append", help="stop token id (repeatable)")
    gen.set_defaults(func=_generate)

    srv = commands.add_parser("serve", help="serve the OpenAI-compatible API (SSE and WebSockets)")
    _add_model_flags(srv)
    srv.add_argument("--tenants", default=None, help="tenants TOML (keys, plans, limits); unset: open")
    srv.add_argument("--redis-url", default=None, help="shared Redis for ledger, limits, prefix index")
    srv.add_argument("--data-dir", default=None, help="SQLite ledger and usage journal folder")
    srv.add_argument("--router", choices=["embedded", "dynamo"], default=None,
                     help="embedded: run the engine here (default); dynamo: send requests to workers")
    srv.add_argument("--routing", choices=ROUTING_MODES, default=None,
                     help="with --router dynamo: Dynamo's KV-aware router (default), or round robin, or random")
    srv.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                     help="how tool_choice auto reads calls from the output (default: auto, from the chat template)")
    srv.set_defaults(func=_serve)

    wrk = commands.add_parser("worker", help="run the engine as a Dynamo worker (behind `serve --router dynamo`)")
    _add_model_flags(wrk)
    wrk.add_argument("--kv-events-endpoint", default=None,
                     help="also publish vLLM-format KV events on this ZMQ PUB address (e.g. tcp://*:5557; "
                          "tcp://127.0.0.1:* takes a free port and logs it; ipc:///path a Unix socket)")
    wrk.add_argument("--kv-events-replay-endpoint", default=None,
                     help="answer replay requests for recent KV event batches here (ZMQ ROUTER)")
    wrk.set_defaults(func=_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        configure_logging(args.log_level or "warning")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
