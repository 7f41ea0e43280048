"""The `pagedserve` command: `pagedserve generate --model DIR|demo "prompt"`."""

from __future__ import annotations

import argparse
import os
import sys

from service.logs import configure_logging


def _generate(args: argparse.Namespace) -> int:
    from runtime import Engine, InvalidRequestError, SamplingParams

    engine = Engine.from_pretrained(
        args.model, show_progress=True, settings_file=args.config, device=args.device, dtype=args.dtype,
        num_blocks=args.num_blocks,
    )
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


def _serve(args: argparse.Namespace) -> int:
    from config import ConfigError, load_settings
    from service.server import run

    try:
        settings = load_settings(args.config, overrides={
            "server": {"model": args.model, "host": args.host, "port": args.port,
                       "served_model_name": args.served_model_name, "tenants_file": args.tenants,
                       "redis_url": args.redis_url, "data_dir": args.data_dir},
            "engine": {"device": args.device, "dtype": args.dtype, "num_blocks": args.num_blocks,
                       "max_num_seqs": args.max_num_seqs},
        })
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level or settings.server.log_level, settings.server.log_json)
    run(settings)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with a paged KV cache")
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="demo", help="Hugging Face checkpoint folder, or 'demo' (random weights)")
    gen.add_argument("--config", help="TOML settings file (see config/default.toml)")
    gen.add_argument("--device", default=None)
    gen.add_argument("--dtype", default=None)
    gen.add_argument("--num-blocks", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", type=int, action="append", help="stop token id (repeatable)")
    gen.set_defaults(func=_generate)

    srv = commands.add_parser("serve", help="serve the OpenAI-compatible API (SSE and WebSockets)")
    srv.add_argument("--model", default=None, help="Hugging Face checkpoint folder, or 'demo' (random weights)")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--host", default=None)
    srv.add_argument("--port", type=int, default=None)
    srv.add_argument("--config", help="TOML settings file (see config/default.toml)")
    srv.add_argument("--tenants", default=None, help="tenants TOML (keys, plans, limits); unset: open")
    srv.add_argument("--redis-url", default=None, help="shared Redis for ledger, limits, prefix index")
    srv.add_argument("--data-dir", default=None, help="SQLite ledger and usage journal folder")
    srv.add_argument("--device", default=None)
    srv.add_argument("--dtype", default=None)
    srv.add_argument("--num-blocks", type=int, default=None)
    srv.add_argument("--max-num-seqs", type=int, default=None)
    srv.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        configure_logging(args.log_level or "warning")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
