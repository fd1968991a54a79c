"""RL-layer costs: update_weights vs a plain in-place copy, and n=8 groups vs 8 separate prompts, on the W1 model or a
real small-LM shape (`--model`, random weights) in fp32 or bf16.

A weight sync on CPU also costs the next forward the refresh of the oneDNN-packed linear weights (packed_linear.py):
it is timed with the update ("+ next forward's repack", the whole sync) and alone.

    python benchmarks/rl_layer.py [--threads 2] [--repeats 5]
    python benchmarks/rl_layer.py --model qwen3-0.6b --dtype bfloat16 --sync-only

Both comparisons run side by side in one process; read the ratios, not the absolute seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import build_w1, cpu_flags, format_table
from benchmarks.shapes import MODEL_CHOICES, build_named
from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from rollout.engine.cpu.packed_linear import PackedLinears


def _time_interleaved(fns: list, repeats: int) -> list[float]:
    """Median seconds of each function, timed round-robin so load drift hits all of them alike."""
    for fn in fns:
        fn()  # warm-up
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def weight_sync(gen: RolloutGenerator, trainer: torch.nn.Module, repeats: int) -> list[list]:
    targets = dict(gen.model.named_parameters())
    sources = dict(trainer.named_parameters())

    @torch.no_grad()
    def plain_copy():
        for name, param in targets.items():
            param.copy_(sources[name])

    def stream():
        return ((name, t.detach()) for name, t in trainer.named_parameters())

    linears = gen.manager.engine.runner.linears

    def repack():
        """What the next forward pays for new weights: refreshing the packed copy of every linear weight it packs."""
        if isinstance(linears, PackedLinears):
            linears.prepare()

    def synced():
        gen.update_weights(trainer)
        repack()

    def repack_alone():
        if isinstance(linears, PackedLinears):
            linears.clear()  # what every weight update does
        repack()

    bf16 = {k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()}
    repack()  # the packed copies exist, as in an engine that has run a step: an update writes them too where it can
    # the repacks get their own round and baseline, so that none of the updates above pays for freeing packed copies
    plain, module, streamed, converted = _time_interleaved(
        [plain_copy, lambda: gen.update_weights(trainer), lambda: gen.update_weights(stream()),
         lambda: gen.update_weights(bf16)], repeats)
    plain2, sync, alone = _time_interleaved([plain_copy, synced, repack_alone], repeats)
    return [["plain in-place copy (no checks)", f"{plain * 1e3:.1f}", "1.00"],
            ["update_weights(module)", f"{module * 1e3:.1f}", f"{module / plain:.2f}"],
            ["update_weights(stream of pairs)", f"{streamed * 1e3:.1f}", f"{streamed / plain:.2f}"],
            ["update_weights(bf16 state dict)", f"{converted * 1e3:.1f}", f"{converted / plain:.2f}"],
            ["plain in-place copy (baseline of the next two)", f"{plain2 * 1e3:.1f}", "1.00"],
            ["update_weights(module) + next forward's repack", f"{sync * 1e3:.1f}", f"{sync / plain2:.2f}"],
            ["  the repack alone", f"{alone * 1e3:.1f}", f"{alone / plain2:.2f}"]]


def groups(gen: RolloutGenerator, repeats: int) -> list[list]:
    work = build_w1(scale=0.25, vocab_size=gen.model.config.vocab_size)
    prompts = work.prompts
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=64, ignore_eos=True, seed=0)

    def grouped():
        gen.manager.engine.reset_prefix_cache()
        return gen.generate(prompts, n=8, sampling_params=params)

    def separate():
        gen.manager.engine.reset_prefix_cache()
        return gen.generate([p for p in prompts for _ in range(8)], n=1, sampling_params=params)

    t_group, t_sep = _time_interleaved([grouped, separate], repeats)
    g, s = grouped().stats, separate().stats
    return [["n=8 groups", f"{t_group:.2f}", str(g["prefill_tokens"]), str(g["prefix_hit_tokens"]), "1.00"],
            ["8 separate prompts, n=1", f"{t_sep:.2f}", str(s["prefill_tokens"]), str(s["prefix_hit_tokens"]),
             f"{t_sep / t_group:.2f}"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="w1", choices=MODEL_CHOICES,
                        help="W1's 25.7M toy model (default) or a real small-LM shape with random weights")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sync-only", action="store_true", help="time the weight sync only (not the n=8 groups)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trainer = build_named(args.model, args.dtype)
    trainer.requires_grad_(True)
    gen = RolloutGenerator(trainer, continuous_batching_config=ContinuousBatchingConfig(page_size=32))
    params = sum(p.numel() for p in trainer.parameters())
    print(f"{args.model} model: {params / 1e6:.1f}M parameters, {args.dtype}, {args.threads} threads; CPU flags: "
          f"{cpu_flags()}\n")
    print(format_table(["weight sync", "ms (median)", "x plain copy"], weight_sync(gen, trainer, args.repeats)))
    if args.sync_only:
        gen.close()
        return
    print()
    print(format_table(["8 samples of 8 prompts (64 new tokens each)", "s (median)", "prefill tokens",
                        "prefix-hit tokens", "time x groups"], groups(gen, max(1, args.repeats // 2))))
    gen.close()


if __name__ == "__main__":
    main()
