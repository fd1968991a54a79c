"""Sync against async RL on the demo task, in one process: samples/s, waiting, staleness, and memory over a long run.

    python benchmarks/async_rl.py --max-staleness 0,1,2 --steps 60
    python benchmarks/async_rl.py --max-staleness 1 --steps 500 --report-at 50,500   # RSS and KV stay flat
    python benchmarks/async_rl.py --backend server     # generation in a `rollout serve` process on core 1

Each run is the loop of `rollout demo --async` (rollout.demo.async_grpo) on the embedded policy, with the same
seeds; `max_staleness=0` is the same loop made synchronous. In process (`--backend engine`) the engine's loop and the
trainer get `--engine-threads` and the rest of `--threads`; with `--backend server` the trainer is pinned to core 0
and a `rollout serve` process with one thread to core 1, and weights stream to it over HTTP after every step.
Prints one table row per run, and the RSS and KV blocks in use at each `--report-at` step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

import torch
from common import cpu_flags, current_rss_mib
from serving import free_port, stop_server, wait_ready

from rollout import AsyncRollouts, ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from rollout.demo import task
from rollout.demo.async_grpo import optimizer_step
from rollout.distributed import RolloutServerPool
from rollout.loading import DEFAULT_MODEL, load_model
from rollout.thread_teams import split_threads


@contextlib.contextmanager
def served(args):
    """A `rollout serve` process of the embedded policy on core 1 (one thread); yields its URL."""
    port = free_port()
    cmd = ["taskset", "-c", "1", sys.executable, "-c", "import sys; from rollout.cli import main; sys.exit(main())",
           "serve", "--model", str(DEFAULT_MODEL), "--port", str(port), "--log-level", "warning", "--cpu-threads",
           "1", "--page-size", "16", "--seed", str(args.seed)]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1", proc, 300)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def backend_for(args, model, tokenizer, stack: contextlib.ExitStack):
    """(backend, engine_threads): the in-process generator, or a pool over one served process."""
    if args.backend == "server":
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        pool = stack.enter_context(RolloutServerPool([stack.enter_context(served(args))], seed=args.seed))
        pool.update_weights(model)  # the served copy starts from the trainer's weights (version 1 on both sides)
        return pool, None
    engine_threads, trainer_threads = split_threads(args.threads, args.engine_threads, "--engine-threads")
    torch.set_num_threads(trainer_threads)
    generator = stack.enter_context(RolloutGenerator(model, tokenizer=tokenizer, seed=args.seed,
                                    continuous_batching_config=ContinuousBatchingConfig(page_size=16)))
    return generator, engine_threads


def run(max_staleness: int, args) -> dict:
    with contextlib.ExitStack() as stack:
        return _run(max_staleness, args, stack)


def _run(max_staleness: int, args, stack: contextlib.ExitStack) -> dict:
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(str(DEFAULT_MODEL), torch.float32)
    generator, engine_threads = backend_for(args, model, tokenizer, stack)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    marks, rewards, times, waits, idles, behind, p99, top, clipped = {}, [], [], [], [], [], [], [], []
    start = time.perf_counter()
    with AsyncRollouts(generator, task.make_prompts(args.steps * args.prompts_per_step, seed=args.seed), task.reward,
                       groups_per_batch=args.prompts_per_step, n=args.group, sampling_params=params,
                       max_staleness=max_staleness, engine_threads=engine_threads, seed=args.seed) as producer:
        for step, batch in enumerate(producer, start=1):
            metrics = optimizer_step(model, optimizer, batch, 1.0, tokenizer.pad_token_id)
            producer.update_weights(model)
            rewards.append(metrics["reward"])
            times.append(time.perf_counter() - start)
            waits.append(batch.metrics["async/trainer_wait_fraction"])
            idles.append(batch.metrics["async/producer_idle_fraction"])
            behind.append(batch.metrics["async/versions_behind/mean"])
            p99.append(metrics["async/is_ratio/p99"])
            top.append(metrics["async/is_ratio/max"])
            clipped.append(metrics["async/clipped_fraction"])
            if step in args.report_at:
                stats = generator.stats()
                marks[step] = (current_rss_mib(), stats.used_blocks, stats.cached_blocks, stats.num_blocks)
    seconds = time.perf_counter() - start
    to_target = next((i + 1 for i in range(len(times)) if _moving_mean(rewards, i) >= args.target), None)
    steps = len(rewards)
    return {"max_staleness": max_staleness, "steps": steps, "seconds": seconds,
            "samples_per_second": steps * args.prompts_per_step * args.group / seconds,
            "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]), "trainer_wait": sum(waits) / steps,
            "engine_idle": sum(idles) / steps, "behind": sum(behind) / steps, "marks": marks, "rewards": rewards,
            "is_p99": sum(p99) / steps, "is_max": max(top), "clipped": sum(clipped) / steps,
            "target_step": to_target, "target_seconds": times[to_target - 1] if to_target else None}


def _moving_mean(values: list[float], i: int, window: int = 5) -> float:
    """Mean of the `window` values ending at index i (fewer at the start)."""
    part = values[max(0, i - window + 1):i + 1]
    return sum(part) / len(part)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-staleness", default="0,1,2", help="comma-separated values, run in this order")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--backend", choices=["engine", "server"], default="engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine-threads", type=int, default=None)
    parser.add_argument("--report-at", default="", help="steps at which to record RSS and KV blocks in use")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write the runs' reward curves to this PNG")
    parser.add_argument("--target", type=float, default=0.9, help="the reward target whose wall-clock is reported")
    args = parser.parse_args()
    args.report_at = {int(s) for s in args.report_at.split(",") if s}
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; backend: {args.backend}")
    print("| max_staleness | steps | s | samples/s | x first row | reward (last 10) | trainer waiting | engine idle "
          "| versions behind | IS ratio p99 (mean over steps) | IS ratio max | tokens clipped "
          f"| reward >= {args.target} (5-step mean): step, s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    first, curves = None, {}
    for value in [int(s) for s in args.max_staleness.split(",")]:
        row = run(value, args)
        curves[value] = row["rewards"]
        first = first or row["samples_per_second"]
        print(f"| {value} | {row['steps']} | {row['seconds']:.1f} | {row['samples_per_second']:.0f} | "
              f"{row['samples_per_second'] / first:.2f} | {row['reward_last10']:.3f} | {row['trainer_wait']:.0%} | "
              f"{row['engine_idle']:.0%} | {row['behind']:.2f} | {row['is_p99']:.3f} | {row['is_max']:.2f} | "
              f"{row['clipped']:.4%} | {_target(row)} |", flush=True)
        for step, (rss, used, cached, total) in sorted(row["marks"].items()):
            print(f"|   step {step}: RSS {rss:.0f} MiB, KV blocks of {total}: {used} in use, {cached} cached | | | | | "
                  "| | | |")
    if args.plot:
        plot(curves, args.plot)


def _target(row: dict) -> str:
    return "not reached" if row["target_step"] is None else f"{row['target_step']}, {row['target_seconds']:.1f}"


def plot(curves: dict[int, list[float]], path: str) -> None:
    """Reward per optimizer step of each run, on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for staleness, rewards in curves.items():
        label = "synchronous (max_staleness=0)" if staleness == 0 else f"async, max_staleness={staleness}"
        ax.plot(range(1, len(rewards) + 1), rewards, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("batch reward")
    ax.set_title("demo task: reward per step, sync against async")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"reward curves: {path}")


if __name__ == "__main__":
    main()
