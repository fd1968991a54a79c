"""Preemption with and without CPU offload: a KV cache far smaller than the batch, long prompts.

A SmolLM2-135M-shaped model (random weights, fp32; `--model` picks another) samples 512 tokens for each of the batch's
sequences (T=1, per-request seeds) in a cache that holds a few of them. Without offload (`cpu_offload_space=0`, the
default) a preempted sequence recomputes its prompt and generated tokens when it resumes (prefix-cache hits aside);
with it, its KV waits in a CPU swap space and is copied back. Two shapes: distinct prompts, and GRPO groups of 4
samples sharing one prompt. One invocation, same requests:

    python benchmarks/cpu_offload.py
    python benchmarks/cpu_offload.py --model w1 --prompt-len 384 --new-tokens 128 --prompts 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import build_model, cpu_flags, environment, format_table, log
from benchmarks.shapes import REAL_SHAPES, build_real
from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams

PAGE = 32


def run(model, prompts: list[list[int]], n: int, new_tokens: int, num_blocks: int, offload: float) -> dict:
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks,
                                                              cpu_offload_space=offload))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, f"p{i}", SamplingParams(n=n, temperature=1.0, seed=i, max_new_tokens=new_tokens,
                                                           ignore_eos=True))
    outputs = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.is_finished()})
    wall = time.perf_counter() - start
    stats = engine.stats()
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    errors = [o.error for o in outputs.values() if o.error is not None]
    if errors:
        log(f"{len(errors)} sequences failed, e.g.: {errors[0]}")
    return dict(wall_s=wall, tok_s=generated / wall, steps=stats.steps, preemptions=stats.preemptions,
                prefill=stats.prefill_tokens,
                recomputed=stats.prefill_tokens + stats.prefix_hit_tokens - sum(map(len, prompts)),
                hits=stats.prefix_hit_tokens, out_blocks=stats.swapped_out_blocks, in_blocks=stats.swapped_in_blocks,
                tokens={rid: o.generated_tokens for rid, o in outputs.items()},
                failed=len(errors))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts (groups: a quarter as many, n=4)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--room-for", type=int, default=4, help="the cache holds this many whole sequences")
    p.add_argument("--offload-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2, help="best wall-clock of this many runs per row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="distinct,groups", help="distinct, groups or both")
    p.add_argument("--model", default="smollm2-135m", choices=["w1", *REAL_SHAPES],
                   help="w1 (25.7M) or a real shape with random weights")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model("float32") if args.model == "w1" else build_real(args.model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    blocks = args.room_for * -(-(args.prompt_len + args.new_tokens) // PAGE)
    rows = []
    workloads = {"distinct": ("distinct prompts", args.prompts, 1), "groups": ("groups of 4", args.prompts // 4, 4)}
    for label, count, n in (workloads[name] for name in args.workloads.split(",")):
        prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(count)]
        results = {}
        for offload in (0.0, args.offload_gib):
            log(f"--- {label}, offload {offload} GiB")
            runs = [run(model, prompts, n, args.new_tokens, blocks, offload) for _ in range(args.repeats)]
            results[offload] = r = min(runs, key=lambda x: x["wall_s"])
            rows.append([label, f"{offload:g}", blocks, r["steps"], r["preemptions"], r["prefill"], r["recomputed"],
                         r["hits"], r["out_blocks"], r["in_blocks"], f"{r['wall_s']:.2f}", f"{r['tok_s']:.0f}",
                         r["failed"]])
        off, on = results[0.0], results[args.offload_gib]
        same = sum(off["tokens"][k] == on["tokens"][k] for k in off["tokens"])
        rows.append([label, "on/off", "", "", "", "", "", "", "", "", f"{off['wall_s'] / on['wall_s']:.2f}x faster", "",
                     f"{same}/{len(off['tokens'])} same tokens"])
    env = environment()
    print(f"CPU offload: {args.model} model fp32, {args.prompt_len}-token prompts + {args.new_tokens} sampled, "
          f"page {PAGE}, cache of {blocks} blocks (room for {args.room_for} sequences), threads={args.threads}, torch "
          f"{env['torch']}, commit {env.get('git_commit')}, CPU flags: {cpu_flags()}")
    print(format_table(["workload", "offload GiB", "cache blocks", "steps", "preemptions", "prefill tokens",
                        "recomputed", "prefix hits", "swapped out", "swapped in", "wall s", "tok/s", "failed"], rows))


if __name__ == "__main__":
    main()
