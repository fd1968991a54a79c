"""W1 throughput of our engine at several KV page sizes, interleaved in one invocation.

The page size default is per device (`rollout/config.py` DEFAULT_PAGE_SIZE); this is the measurement behind the CPU
value. Each page size runs as its own `throughput.py` engine child (same workload, seeds and warm-up), and the order
rotates every repeat so no size always goes first on a shared machine.

    python benchmarks/page_size.py                            # 16, 32, 64, 256 on full W1, best of 2
    python benchmarks/page_size.py --sizes 32,256 --repeats 3 --scale 0.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import throughput
from benchmarks.common import environment, format_table, log


def measure(sizes: list[int], args: argparse.Namespace) -> dict[int, dict]:
    """Best-of-repeats engine result per page size."""
    runs: dict[int, list[dict]] = {size: [] for size in sizes}
    for rep in range(args.repeats):
        order = sizes[rep % len(sizes):] + sizes[:rep % len(sizes)]
        for size in order:
            log(f"--- page_size={size} (run {rep + 1}/{args.repeats})")
            args.engine_page_size = size
            runs[size].append(throughput.run_child(args, "engine"))
    return {size: throughput.best_of("engine", runs[size]) for size in sizes}


def print_table(results: dict[int, dict], args: argparse.Namespace) -> None:
    env = environment()
    print(f"W1 engine throughput by page size  scale={args.scale}  dtype={args.dtype}  threads={args.threads}  "
          f"torch {env['torch']}  commit {env.get('git_commit')}")
    ok = {size: r for size, r in results.items() if not r.get("failed")}
    best = max((r["useful_tok_s"] for r in ok.values()), default=0.0)
    rows = []
    for size, r in results.items():
        if r.get("failed"):
            rows.append([size, "FAILED", "-", "-", r.get("error", "")])
            continue
        rows.append([size, f"{r['useful_tok_s']:.1f}", f"{r['useful_tok_s'] / best:.2f}",
                     f"{r['peak_rss_mib']:.0f}", "/".join(str(x) for x in r["runs_tok_s"])])
    print(format_table(["page_size", "useful tok/s", "vs best", "peak RSS MiB", "runs tok/s"], rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,32,64,256", help="comma-separated page sizes")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="fraction of W1's prompts")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    # everything else a throughput.py child needs, at its defaults
    child = throughput.parse_args(["--scale", repr(args.scale), "--dtype", args.dtype, "--threads", str(args.threads)])
    child.repeats = args.repeats
    print_table(measure(sizes, child), args)


if __name__ == "__main__":
    main()
