"""What `default_compile_level` costs and buys on this machine: compile time cold vs warm, and step latency per shape.

    python benchmarks/compile_levels.py start              # cold then warm start, two fresh processes, W1 model
    python benchmarks/compile_levels.py start --tiny       # the same with the 2-layer test model
    python benchmarks/compile_levels.py shapes --levels 0,1,3   # one forward per shape, eager vs compiled
    python benchmarks/compile_levels.py w1 --levels 0,1,3       # W1 throughput once every graph is compiled
    python benchmarks/compile_levels.py steps --levels 0,1      # whole engine steps of R greedy decode rows

`start`: two child processes share one new inductor cache directory; each builds an engine at `--level` and runs the
throughput warm-up workload (the first steps compile). The first process compiles cold, the second finds its graphs
in inductor's FX graph cache and AOTAutograd cache (on by default in torch 2.13; dynamo still traces in every new
process). Reported: time of the first step (the first compile), the whole warm-up, and the cache hit/miss counters.

`shapes`: one engine per level over the same W1 model in one process; per shape (decode steps of R rows at context
C, prefill chunks of T tokens), each level's runner forward is timed best-of-N in rotating order, so a shared machine
hurts every level alike.

`steps`: whole `engine.step()`s (schedule, forward, sample, update) of R greedy rows decoding 40 tokens after a
55-token prompt, one engine per level in one process, the levels interleaved; median ms per step over `--repeats`
rounds. This is what a server's per-token latency at concurrency R is made of.

`w1`: W1 in one process per level and run, after an untimed W1 pass that compiled every graph the workload needs
(engines with one compile config share their graphs): the steady state of a long-lived process. Each timed run uses
a new engine, in rotating level order, best of `--repeats`. `throughput.py --systems engine,engine_compiled` instead
times a fresh process after a small warm-up, so shapes first seen in the timed run compile inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import build_model, build_warmup, environment, format_table, log

DECODE_SHAPES = [(1, 256), (8, 256), (64, 256), (256, 256)]  # (rows, context)
PREFILL_SHAPES = [64, 512, 2048]  # tokens of one prompt chunk


def _model(args: argparse.Namespace):
    if args.tiny:
        import torch

        from tests.helpers.models import tiny_model

        return tiny_model("qwen3").to(getattr(torch, args.dtype))
    return build_model(args.dtype)


def start_child(args: argparse.Namespace) -> None:
    """One process: engine at --level, the warm-up workload; prints a JSON line."""
    import torch
    from torch._dynamo.utils import counters

    from rollout import ContinuousBatchingConfig, SamplingParams
    from rollout.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = _model(args)
    engine = LLMEngine(model, None, ContinuousBatchingConfig(default_compile_level=args.level))
    work = build_warmup(model.config.vocab_size)
    for i, (_, prompt, n) in enumerate(work.sequences()):
        engine.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=n, temperature=1.0, seed=i,
                                                                  ignore_eos=True))
    t1 = time.perf_counter()
    engine.step()
    first = time.perf_counter() - t1
    while engine.has_unfinished():
        engine.step()
    compiled = engine.runner.compiled
    print(json.dumps(dict(
        first_step_s=first, warmup_s=time.perf_counter() - t1, process_s=time.perf_counter() - t0,
        graphs=compiled.num_compiles if compiled else 0,
        fxgraph=dict(counters["inductor"]), aot=dict(counters["aot_autograd"]))))


def start(args: argparse.Namespace) -> None:
    cache = tempfile.mkdtemp(prefix="rollout-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(args.threads)}
    argv = [sys.executable, os.path.abspath(__file__), "start-child", "--level", str(args.level), "--threads",
            str(args.threads), "--dtype", args.dtype] + (["--tiny"] if args.tiny else [])
    rows = []
    for name in ("cold", "warm"):
        log(f"--- {name} start (cache {cache})")
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        hits = {k: v for k, v in {**r["fxgraph"], **r["aot"]}.items() if "cache" in k}
        rows.append([name, f"{r['first_step_s']:.1f}", f"{r['warmup_s']:.1f}", f"{r['process_s']:.1f}", r["graphs"],
                     " ".join(f"{k}={v}" for k, v in sorted(hits.items()))])
    env_info = environment()
    print(f"compile start, level {args.level}, {'tiny 2-layer Qwen3' if args.tiny else 'W1 Qwen3'}, threads "
          f"{args.threads}, torch {env_info['torch']}")
    print(format_table(["start", "first step s", "warm-up s", "process s", "graphs", "caches"], rows))


def _compare(name: str, ms: dict[int, float], levels: list[int]) -> list:
    """A table row (ms per level, then each level's speed-up over the first) and its log line."""
    log(f"{name}: " + ", ".join(f"level {level} {ms[level]:.2f} ms" for level in levels))
    return [name, *(f"{ms[level]:.2f}" for level in levels),
            *(f"{ms[levels[0]] / ms[level]:.2f}x" for level in levels[1:])]


def _plan(rows: int, context: int, chunk: int, page: int, first_block: int):
    """A StepPlan of `rows` requests at `context` tokens each running their last `chunk` tokens."""
    from rollout.engine.core.request import Request
    from rollout.engine.core.step import StepPlan
    from rollout.engine.sample.resolve import resolve_sampling

    plan, block = StepPlan(), first_block
    for r in range(rows):
        req = Request(f"r{r}", [(7 * r + i) % 4000 for i in range(context)], resolve_sampling(None, None))
        blocks = -(-context // page)
        req.block_tables = [list(range(block, block + blocks))]
        block += blocks
        req.num_computed = context - chunk
        plan.add(req, chunk)
    return plan


def shapes(args: argparse.Namespace) -> None:
    import torch

    from rollout import ContinuousBatchingConfig
    from rollout.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    model = _model(args)
    blocks = max(r * -(-c // 32) for r, c in DECODE_SHAPES) + max(-(-t // 32) for t in PREFILL_SHAPES) + 2
    runners = {}
    for level in levels:
        engine = LLMEngine(model, None, ContinuousBatchingConfig(default_compile_level=level, page_size=32,
                                                                 num_blocks=blocks))
        for t in engine.cache.keys + engine.cache.values:
            t.zero_()
        runners[level] = engine.runner
    cases = [(f"decode {r} rows @ {c}", r, c, 1) for r, c in DECODE_SHAPES] + \
            [(f"prefill {t} tokens", 1, t, t) for t in PREFILL_SHAPES]
    rows = []
    for name, r, c, chunk in cases:
        plan = _plan(r, c, chunk, 32, 0)
        best = {level: float("inf") for level in levels}
        for level in levels:  # warm: compiles, oneDNN kernels, buffers
            runners[level].run(plan)
        for rep in range(args.repeats):
            for level in levels[rep % len(levels):] + levels[:rep % len(levels)]:
                t0 = time.perf_counter()
                runners[level].run(plan)
                best[level] = min(best[level], time.perf_counter() - t0)
        rows.append(_compare(name, {level: best[level] * 1e3 for level in levels}, levels))
    env_info = environment()
    print(f"forward latency per shape (best of {args.repeats}), {'tiny' if args.tiny else 'W1'} Qwen3 {args.dtype}, "
          f"threads {args.threads}, torch {env_info['torch']}")
    print(format_table(["shape", *(f"level {x} ms" for x in levels),
                        *(f"level {x} speedup" for x in levels[1:])], rows))


def w1(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.common import build_w1, useful_tokens
    from benchmarks.throughput import engine_sampling, sample_seed
    from rollout import ContinuousBatchingConfig, generate_batch

    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    model = _model(args)
    work = build_w1(args.scale)
    seqs = work.sequences()
    params = [engine_sampling(1, sample_seed(work.seed, i), max_new_tokens=n) for i, (_, _, n) in enumerate(seqs)]

    def run(level: int) -> float:
        t0 = time.perf_counter()
        config = ContinuousBatchingConfig(default_compile_level=level)
        out = generate_batch(model, [p for _, p, _ in seqs], None, config, sampling_params=params, progress_bar=False)
        wall = time.perf_counter() - t0
        produced = [len(o.generated_tokens) for o in out.values()]
        return useful_tokens(work.max_new_tokens, produced)[0] / wall

    for level in levels:
        t0 = time.perf_counter()
        run(level)
        log(f"level {level}: untimed pass (compiles) {time.perf_counter() - t0:.1f}s")
    runs: dict[int, list[float]] = {level: [] for level in levels}
    for rep in range(args.repeats):
        for level in levels[rep % len(levels):] + levels[:rep % len(levels)]:
            runs[level].append(run(level))
            log(f"level {level}: {runs[level][-1]:.0f} useful tok/s")
    base = max(runs[levels[0]])
    env_info = environment()
    print(f"W1 (scale {args.scale}) useful tok/s once compiled, best of {args.repeats}, {args.dtype}, threads "
          f"{args.threads}, torch {env_info['torch']}")
    print(format_table(["level", "useful tok/s", "vs level " + str(levels[0]), "runs"],
                       [[level, f"{max(runs[level]):.0f}", f"{max(runs[level]) / base:.2f}x",
                         " / ".join(f"{x:.0f}" for x in runs[level])] for level in levels]))


def steps(args: argparse.Namespace) -> None:
    import statistics

    import torch

    from rollout import ContinuousBatchingConfig, SamplingParams
    from rollout.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    model = _model(args)
    engines = {level: LLMEngine(model, config=ContinuousBatchingConfig(default_compile_level=level))
               for level in levels}
    new_tokens = 41

    def step_ms(engine: LLMEngine, rows: int, tokens: int = new_tokens) -> float:
        for r in range(rows):
            engine.add_request(list(range(5 + r, 60 + r)), sampling_params=SamplingParams(max_new_tokens=tokens,
                                                                                          do_sample=False))
        engine.step()  # the prefill
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - t0) / (tokens - 1) * 1e3

    table = []
    for rows in [int(x) for x in args.rows.split(",")]:
        for engine in engines.values():
            step_ms(engine, rows, 5)  # compiles what this row count needs
        times: dict[int, list[float]] = {level: [] for level in levels}
        for _ in range(args.repeats):
            for level, engine in engines.items():
                times[level].append(step_ms(engine, rows))
        table.append(_compare(f"{rows} rows", {level: statistics.median(v) for level, v in times.items()}, levels))
    env_info = environment()
    print(f"ms per engine step of R decode rows, median of {args.repeats} interleaved rounds, {args.dtype}, threads "
          f"{args.threads}, torch {env_info['torch']}")
    print(format_table(["rows", *(f"level {level} ms" for level in levels),
                        *(f"level {level} vs {levels[0]}" for level in levels[1:])], table))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["start", "shapes", "steps", "w1", "start-child"])
    p.add_argument("--rows", default="1,8,32", help="steps: comma-separated decode row counts")
    p.add_argument("--level", type=int, default=1, help="start: the compile level (default 1)")
    p.add_argument("--levels", default="0,1", help="shapes: comma-separated levels, the first is the baseline")
    p.add_argument("--repeats", type=int, default=0, help="timed runs per level (default: shapes 20, w1 3)")
    p.add_argument("--scale", type=float, default=1.0, help="w1: fraction of W1's prompts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the 2-layer test model instead of the W1 model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    args.repeats = args.repeats or {"shapes": 20, "steps": 9}.get(args.what, 3)
    {"start": start, "shapes": shapes, "steps": steps, "w1": w1, "start-child": start_child}[args.what](args)


if __name__ == "__main__":
    main()
