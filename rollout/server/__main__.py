"""`python -m rollout.server --model DIR`: serve a local checkpoint (same options as the CLI's serve command)."""

import argparse

from rollout.server.app import build_parser_args, serve


def main() -> None:
    serve(build_parser_args(argparse.ArgumentParser(prog="python -m rollout.server")).parse_args())


if __name__ == "__main__":
    main()
