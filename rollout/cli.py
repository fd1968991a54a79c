"""The `rollout` command: `rollout demo` (GRPO on the embedded tiny policy) and `rollout serve` (OpenAI-style API).

Building the parser imports neither torch, transformers nor fastapi (the commands import them when they run), so
`rollout --help` and argument errors answer at once. A wrong `--model` or a missing optional extra ends in one line
on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

EXIT_USAGE = 2  # argparse's status for bad arguments; a bad --model or a missing extra is the same kind of mistake


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, except where the help already explains the default or there is
    nothing to show (None, False, a required option)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.required or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The `rollout` parser with both sub-commands (cheap: no torch, transformers or fastapi import)."""
    from rollout.demo.run import add_arguments as demo_arguments
    from rollout.server.cli import build_parser_args as serve_arguments

    parser = argparse.ArgumentParser(prog="rollout", description="RL rollout engine: continuous batching, paged KV "
                                     "cache, exact logprobs, versioned weights.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,serve}")
    demo_help = "GRPO with the rollout engine on the embedded tiny policy (CPU, minutes; needs rollout[demo])"
    demo_arguments(sub.add_parser("demo", help=demo_help, description=demo_help, formatter_class=HelpFormatter))
    serve_help = "OpenAI-compatible server with RL endpoints (needs rollout[serve])"
    serve_arguments(sub.add_parser("serve", help=serve_help, description=serve_help, formatter_class=HelpFormatter))
    return parser


def _configure_logging(level_name: str) -> None:
    """Our own loggers at the chosen level; other libraries (HTTP clients log every request at INFO) only from
    WARNING up, unless debugging."""
    level = logging.getLevelName(level_name.upper())
    others = level if level <= logging.DEBUG else max(level, logging.WARNING)
    logging.basicConfig(level=others, format="%(levelname)s %(name)s: %(message)s")
    for name in ("rollout", "trainer_hooks"):
        logging.getLogger(name).setLevel(level)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (2 with one line on stderr for a bad --model or a missing extra)."""
    args = build_parser().parse_args(argv)
    _configure_logging(getattr(args, "log_level", "info"))
    from rollout.loading import MissingExtraError, ModelLoadError, check_model

    try:
        if args.command == "demo":
            if args.async_mode:  # its module imports torch: --model is checked before that
                from rollout.demo.run import MODEL_ALTERNATIVE

                check_model(args.model, alternative=MODEL_ALTERNATIVE)
                from rollout.demo.async_grpo import main as demo
            else:
                from rollout.demo.run import main as demo
            demo(args)
        else:
            from rollout.server.cli import serve

            serve(args)
    except MissingExtraError as err:
        sys.stderr.write(f"{err}\n")
        return EXIT_USAGE
    except ModelLoadError as err:
        sys.stderr.write(f"rollout {args.command}: {err}\n")
        return EXIT_USAGE
    return 0
