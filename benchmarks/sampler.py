"""The sampler alone at a real vocabulary: `Sampler.sample` on random logits, per row count and sampling setting, and
against another checkout of this repository in the same invocation (each tree in its own subprocess, alternated).

    python benchmarks/sampler.py                                  # vocab 151,936 (Qwen3's), 16 and 64 rows
    python benchmarks/sampler.py --baseline-tree /tmp/before      # before/after a change, ratios per setting
    python benchmarks/sampler.py --vocab 4096 --rows 22           # W1's vocabulary

Prints the median milliseconds of `--repeats` calls per setting (after one warm-up call), the CPU flags and the
commit of each tree.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags, format_table

SETTINGS = {
    "plain (T=1)": dict(temperature=1.0, top_k=0, top_p=1.0),
    "top_p 0.95, T=0.8": dict(temperature=0.8, top_p=0.95),
    "top_k 50, T=0.8": dict(temperature=0.8, top_k=50),
    "top_k 50 + top_p 0.9 + min_p 0.05": dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
}

CHILD = """
import json, statistics, sys, time
sys.path.insert(0, {tree!r})
import torch
from transformers import GenerationConfig
from rollout import SamplingParams
from rollout.engine.sample.resolve import resolve_sampling
from rollout.engine.sample.rows import SampleRow
from rollout.engine.sample.sampler import Sampler

torch.set_num_threads({threads})
sampler = Sampler(0)
out = {{}}
for rows in {rows}:
    logits = torch.randn(rows, {vocab}, generator=torch.Generator().manual_seed(rows)) * 3
    for name, kw in {settings}.items():
        params = resolve_sampling(SamplingParams(seed=1, **kw), GenerationConfig())
        batch = [SampleRow(params, tokens=[1] * 10, num_generated=3) for _ in range(rows)]
        sampler.sample(logits, batch)
        times = []
        for _ in range({repeats}):
            start = time.perf_counter()
            sampler.sample(logits, batch)
            times.append(time.perf_counter() - start)
        out[f"{{rows}}|{{name}}"] = statistics.median(times) * 1e3
print(json.dumps(out))
"""


def run_tree(tree: Path, args) -> dict[str, float]:
    code = CHILD.format(tree=str(tree), threads=args.threads, rows=args.rows, vocab=args.vocab, settings=SETTINGS,
                        repeats=args.repeats)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the trees (default 2); best median kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline-tree", help="another checkout of this repository (git worktree add /tmp/before REV)")
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parent.parent
    trees = {"this tree": here} | ({"baseline": Path(args.baseline_tree).resolve()} if args.baseline_tree else {})
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            for key, ms in run_tree(tree, args).items():
                best[name][key] = min(ms, best[name].get(key, float("inf")))
    print(f"Sampler.sample, vocab {args.vocab:,}, {args.threads} threads, median of {args.repeats} calls, best of "
          f"{args.rounds} rounds")
    print(f"CPU flags: {cpu_flags()}")
    for name, tree in trees.items():
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        print(f"{name}: {tree} at {commit or '?'}")
    headers = ["rows", "setting", *(f"{name} ms" for name in trees)] + (["baseline / this"] if len(trees) > 1 else [])
    table = []
    for key in best["this tree"]:
        rows, setting = key.split("|")
        cells = [f"{best[name][key]:.2f}" for name in trees]
        ratio = [f"{best['baseline'][key] / best['this tree'][key]:.2f}x"] if len(trees) > 1 else []
        table.append([rows, setting, *cells, *ratio])
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
