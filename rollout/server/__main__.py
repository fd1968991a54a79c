"""`python -m rollout.server --model DIR`: the same command as `rollout serve`."""

import sys

from rollout.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", *sys.argv[1:]]))
