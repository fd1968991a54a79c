"""The `rollout` command: `rollout demo` (GRPO on the embedded tiny policy) and `rollout serve` (OpenAI-style API)."""

from __future__ import annotations

import argparse
import logging
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description="RL rollout engine: continuous batching, paged KV "
                                     "cache, exact logprobs, versioned weights.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="GRPO with the rollout engine on the embedded tiny policy (CPU, minutes)")
    from rollout.demo.run import add_arguments as demo_arguments

    demo_arguments(demo)
    serve = sub.add_parser("serve", help="OpenAI-compatible server with RL endpoints (needs rollout[serve])")
    try:
        from rollout.server.app import build_parser_args
    except ImportError as err:  # fastapi/uvicorn missing: say how to get them when the command is used
        serve.set_defaults(_missing=str(err))
    else:
        build_parser_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from rollout.demo.run import run

        run(args)
        return 0
    if getattr(args, "_missing", None):
        sys.stderr.write(f"rollout serve needs the serve extra: pip install 'rollout[serve]' ({args._missing})\n")
        return 2
    from rollout.server.app import serve

    serve(args)
    return 0
