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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with a paged KV cache")
    parser.add_argument("--log-level", default="warning")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
