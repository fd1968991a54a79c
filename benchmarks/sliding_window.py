"""KV memory of a sliding-window model: what one long generation holds, and how many such sequences run at once.

A Mistral-shaped model whose every layer attends over a window of 512 keys (random weights, fp32) generates 4,096
tokens per sequence. With reclaim (the engine's behaviour) a sequence gives back the pages behind its window as it
grows; `reclaim off` reproduces the engine before that (every page kept) by clearing the KV manager's window, a
harness-only patch of engine internals. Same model, same requests, one invocation:

    python benchmarks/sliding_window.py                       # 1 sequence, then 32 sequences in a cache for 4
    python benchmarks/sliding_window.py --new-tokens 1024 --sequences 16
    python benchmarks/sliding_window.py --shared-prefix 1024 --new-tokens 64   # prefix caching on a sliding model
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import MistralConfig, MistralForCausalLM

from benchmarks.common import environment, format_table, log
from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams

PAGE = 32
PROMPT = 20


def build_model(window: int):
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=window,
                           max_position_embeddings=16384, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return MistralForCausalLM(config).eval().requires_grad_(False)


def run(model, sequences: int, new_tokens: int, num_blocks: int, reclaim: bool) -> dict:
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks))
    if not reclaim:
        engine.scheduler.kv.window = None  # as before reclaim: every page kept
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, seed=0, max_new_tokens=new_tokens, ignore_eos=True)
    for i in range(sequences):
        engine.add_request(torch.randint(0, 4096, (PROMPT,), generator=g).tolist(), f"s{i}", params)
    start = time.perf_counter()
    most_running = done = 0
    while engine.has_unfinished():
        done += sum(o.is_finished() and o.error is None for o in engine.step())
        most_running = max(most_running, len(engine.scheduler.running))
    wall = time.perf_counter() - start
    stats = engine.stats()
    bytes_per_block = engine.cache.nbytes // (engine.pool.num_blocks + (engine.cache.scratch_block is not None))
    return dict(reclaim=reclaim, sequences=sequences, finished=done, wall_s=wall, most_running=most_running,
                peak_blocks=stats.peak_used_blocks, peak_kv_mib=stats.peak_used_blocks * bytes_per_block / 2**20,
                preemptions=stats.preemptions, prefill_tokens=stats.prefill_tokens,
                tok_s=sequences * new_tokens / wall)


def shared_prefix(model, requests: int, prefix: int, new_tokens: int, caching: bool) -> dict:
    """Requests whose prompts share `prefix` tokens (a system prompt, a few-shot block), prefix cache on or off
    (off: the engine before sliding models kept it, as transformers does)."""
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=PAGE, allow_block_sharing=caching))
    g = torch.Generator().manual_seed(2)
    head = torch.randint(0, 4096, (prefix,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for i in range(requests):
        engine.add_request(head + torch.randint(0, 4096, (PROMPT,), generator=g).tolist(), f"s{i}", params)
    start = time.perf_counter()
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o.generated_tokens) for o in engine.step() if o.is_finished())
    stats = engine.stats()
    return dict(wall_s=time.perf_counter() - start, prefill_tokens=stats.prefill_tokens,
                hit_tokens=stats.prefix_hit_tokens, outputs=outputs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=4096)
    p.add_argument("--sequences", type=int, default=32, help="sequences of the concurrency run")
    p.add_argument("--room-for", type=int, default=4, help="the concurrency run's cache holds this many full sequences")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="instead: 8 requests whose prompts share this many tokens, prefix cache off and on")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.window)
    if args.shared_prefix:
        return print_shared_prefix(model, args)
    full = -(-(PROMPT + args.new_tokens) // PAGE)
    rows = []
    for label, sequences, blocks in (("one sequence", 1, full + 8),
                                     (f"{args.sequences} sequences, cache for {args.room_for}", args.sequences,
                                      args.room_for * full)):
        for reclaim in (False, True):
            log(f"--- {label}, reclaim={'on' if reclaim else 'off'}")
            r = run(model, sequences, args.new_tokens, blocks, reclaim)
            rows.append([label, "on" if reclaim else "off", blocks, r["peak_blocks"], f"{r['peak_kv_mib']:.1f}",
                         r["most_running"], r["preemptions"], r["prefill_tokens"], f"{r['wall_s']:.1f}",
                         f"{r['tok_s']:.0f}", f"{r['finished']}/{sequences}"])
    env = environment()
    print(f"Sliding window {args.window}, {PROMPT}-token prompts + {args.new_tokens} generated, page {PAGE}, fp32, "
          f"threads={args.threads}, torch {env['torch']}, commit {env.get('git_commit')}")
    print(format_table(["run", "reclaim", "cache blocks", "peak blocks", "peak KV MiB", "most running", "preemptions",
                        "prefill tokens", "wall s", "tok/s", "finished"], rows))


def print_shared_prefix(model, args) -> None:
    runs = {caching: shared_prefix(model, 8, args.shared_prefix, args.new_tokens, caching) for caching in (False, True)}
    rows = [["on" if caching else "off", r["prefill_tokens"], r["hit_tokens"], f"{r['wall_s']:.1f}",
             f"{runs[False]['wall_s'] / r['wall_s']:.2f}x", "yes" if r["outputs"] == runs[False]["outputs"] else "no"]
            for caching, r in runs.items()]
    env = environment()
    print(f"Sliding window {args.window}: 8 requests, {args.shared_prefix} shared + {PROMPT} own prompt tokens, "
          f"{args.new_tokens} greedy tokens each, page {PAGE}, fp32, threads={args.threads}, cpu flags "
          f"{env['cpu_flags']}, commit {env.get('git_commit')}")
    print(format_table(["prefix cache", "prefill tokens", "prefix-hit tokens", "wall s", "speed-up", "same tokens"],
                       rows))


if __name__ == "__main__":
    main()
