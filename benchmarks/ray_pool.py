"""RolloutPool on a local Ray cluster: rollout time vs workers, and weight-broadcast time vs model size and workers.

    python benchmarks/ray_pool.py [--scale 0.25] [--max-new 64] [--sizes 25,100] [--workers 1,2] [--repeats 3]

Part 1 runs one W1-shaped batch (the first `--scale` of W1's prompts, 8 samples each, `--max-new` tokens each) through
one RolloutGenerator in this process (1 and 2 threads) and through pools of 1 and 2 workers (1 CPU and 1 thread
each), after a warm-up batch. Part 2 builds a pool per (model size, workers) and times `update_weights` of a
perturbed copy of the model (median of `--repeats`), split into its phases: gathering to CPU, one put into the object
store, staging (validation) on every worker, commit (the in-place copy); the in-process `update_weights` of one
RolloutGenerator is the floor. Sizes: 25 is W1's model (25.7M parameters), 100 a wider Qwen3 (hidden 1024, 8 layers,
~98M). Numbers feed docs/scaling.md. On a 2-core machine two workers share the cores with the driver and Ray, so
part 1 cannot show a speed-up there; it shows the pool's overhead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import MODEL_CONFIG, build_w1, format_table

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams

SIZES = {  # label -> Qwen3Config overrides of W1's config
    "25": {},
    "100": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8),
}


def build(size: str, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**MODEL_CONFIG, **SIZES[size]})).eval()
    model.requires_grad_(False)
    return model


def perturbed(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


def rollout(args) -> str:
    from rollout.distributed import RolloutPool

    model = build("25")
    work = build_w1(scale=args.scale)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, ignore_eos=True, seed=0)
    config = ContinuousBatchingConfig(num_blocks=512)  # 16k tokens of KV at the CPU page size (32): room for all
    requested = len(work.prompts) * work.samples * args.max_new
    rows = []

    def timed(run, label):
        run()  # warm-up: first-call costs (kernels, allocator, Ray's task path)
        seconds = statistics.median(_time(run) for _ in range(args.repeats))
        rows.append([label, f"{seconds:.2f}", f"{requested / seconds:.0f}"])

    for threads in (1, 2):
        torch.set_num_threads(threads)
        with RolloutGenerator(model, continuous_batching_config=config) as gen:
            timed(lambda g=gen: g.generate(work.prompts, n=work.samples, sampling_params=params),
                  f"one RolloutGenerator, {threads} thread(s), in process")
    torch.set_num_threads(1)
    for workers in args.workers:
        with RolloutPool(model, workers=workers, continuous_batching_config=config, num_cpus=1, torch_threads=1
                         ) as pool:
            timed(lambda p=pool: p.generate(work.prompts, n=work.samples, sampling_params=params),
                  f"RolloutPool, {workers} worker(s) x 1 CPU x 1 thread")
    base = float(rows[0][1])
    for row in rows:
        row.append(f"{base / float(row[1]):.2f}")
    return (f"Rollout: {len(work.prompts)} prompts x {work.samples} samples x {args.max_new} tokens "
            f"({requested} tokens), median of {args.repeats}\n"
            + format_table(["system", "seconds", "tokens/s", "speed vs 1 thread"], rows))


def broadcast(args) -> str:
    from rollout.distributed import RolloutPool

    rows = []
    config = ContinuousBatchingConfig(num_blocks=64)
    for size in args.sizes:
        model = build(size)
        params = sum(p.numel() for p in model.parameters())
        mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
        updates = [perturbed(model, seed) for seed in range(args.repeats)]
        with RolloutGenerator(model, continuous_batching_config=config) as gen:
            floor = statistics.median(_time(lambda u=u: gen.update_weights(u)) for u in updates)
        rows.append([f"{params / 1e6:.1f}M", f"{mb:.0f}", "in process", f"{floor:.3f}", "", "", "", "",
                     f"{mb / 1024 / floor:.2f}"])
        for workers in args.workers:
            with RolloutPool(model, workers=workers, continuous_batching_config=config, num_cpus=1 / workers,
                             torch_threads=1) as pool:
                pool.update_weights(updates[0])  # warm-up
                timings = []
                for update in updates:
                    pool.update_weights(update)
                    timings.append({**pool.last_update_timing, "total": pool.last_update_seconds})
            phase = {k: statistics.median(t[k] for t in timings) for k in timings[0]}
            rows.append([f"{params / 1e6:.1f}M", f"{mb:.0f}", f"pool x{workers}", f"{phase['total']:.3f}",
                         f"{phase['collect']:.3f}", f"{phase['publish']:.3f}", f"{phase['stage']:.3f}",
                         f"{phase['commit']:.3f}", f"{workers * mb / 1024 / phase['total']:.2f}"])
        del model, updates
    return (f"Weight broadcast (fp32, median of {args.repeats}; GB/s = bytes delivered to all workers / total)\n"
            + format_table(["params", "MiB", "where", "total s", "collect", "publish", "stage", "commit", "GB/s"],
                           rows))


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.25, help="share of W1's 32 prompts (default 0.25: 8)")
    parser.add_argument("--max-new", type=int, default=64, help="tokens per sample (EOS ignored)")
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=["25", "100"], help="model sizes: 25,100")
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", choices=["rollout", "broadcast"], help="skip one part")
    args = parser.parse_args()
    if bad := [s for s in args.sizes if s not in SIZES]:
        parser.error(f"unknown --sizes {bad}; choose from {sorted(SIZES)}")
    import os

    import ray

    torch.set_num_threads(1)
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    print(f"{os.cpu_count()} CPUs; 1-minute load average before: {os.getloadavg()[0]:.1f} (others' work on the same "
          "cores slows every row)", flush=True)
    try:
        if args.skip != "rollout":
            print(rollout(args), flush=True)
            print()
        if args.skip != "broadcast":
            print(broadcast(args), flush=True)
    finally:
        ray.shutdown()
    print(f"1-minute load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
