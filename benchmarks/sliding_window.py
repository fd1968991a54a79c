"""KV memory of a sliding-window model: what one long generation holds, and how many such sequences run at once.

A Mistral-shaped model whose every layer attends over a window of 512 keys (random weights, fp32), or a Gemma 2-shaped
hybrid whose layers alternate between that window and full attention (`--model gemma2`), generates 4,096 tokens per
sequence. With reclaim (the engine's behaviour) the sliding layers give back the pages behind their window as a
sequence grows, under block tables of their own in a hybrid; `reclaim off` reproduces the engine before that (one
table for every layer, every page kept) by handing the engine one KV group, a harness-only patch of engine internals.
Both settings get the same KV memory. Same model, same requests, one invocation:

    python benchmarks/sliding_window.py                       # 1 sequence, then 32 sequences in a cache for 4
    python benchmarks/sliding_window.py --model gemma2        # the hybrid
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
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from benchmarks.common import environment, format_table, log
from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams
from rollout.engine.core.kv_groups import KVGroups

PAGE = 32
PROMPT = 20


def build_model(window: int, kind: str = "mistral"):
    torch.manual_seed(0)
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, sliding_window=window, max_position_embeddings=16384,
                 eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if kind == "gemma2":  # layers 0 and 2 slide, 1 and 3 attend to every key
        return Gemma2ForCausalLM(Gemma2Config(**shape)).eval().requires_grad_(False)
    return MistralForCausalLM(MistralConfig(**shape)).eval().requires_grad_(False)


def engine_for(model, reclaim: bool, kv_bytes: int, **config) -> LLMEngine:
    """An engine whose cache holds `kv_bytes` of KV. `reclaim=False`: every layer in one KV group that keeps every
    page, as the engine was before sliding layers reclaimed theirs."""
    layers = model.config.num_hidden_layers
    original = LLMEngine._kv_groups
    if not reclaim:
        LLMEngine._kv_groups = lambda self, *args: KVGroups.single(layers)
    try:
        slots = LLMEngine(model, config=ContinuousBatchingConfig(page_size=PAGE, num_blocks=1)).kv_groups.num_slots
        bytes_per_block = 2 * slots * PAGE * model.config.num_key_value_heads * model.config.head_dim * 4
        return LLMEngine(model, config=ContinuousBatchingConfig(page_size=PAGE, num_blocks=kv_bytes // bytes_per_block,
                                                                **config))
    finally:
        LLMEngine._kv_groups = original


def run(model, sequences: int, new_tokens: int, kv_bytes: int, reclaim: bool) -> dict:
    engine = engine_for(model, reclaim, kv_bytes)
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
                blocks=engine.pool.num_blocks, groups=engine.kv_groups.num_groups,
                peak_blocks=stats.peak_used_blocks, peak_kv_mib=stats.peak_used_blocks * bytes_per_block / 2**20,
                preemptions=stats.preemptions, prefill_tokens=stats.prefill_tokens,
                tok_s=sequences * new_tokens / wall)


def shared_prefix(model, requests: int, prefix: int, new_tokens: int, caching: bool) -> dict:
    """Requests whose prompts share `prefix` tokens (a system prompt, a few-shot block), prefix cache on or off
    (off: the engine before sliding models kept it, as transformers does)."""
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=PAGE, allow_block_sharing=caching))
    assert engine.pool.enable_prefix_cache == caching
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
    p.add_argument("--model", choices=["mistral", "gemma2"], default="mistral",
                   help="mistral: every layer slides; gemma2: sliding and full layers alternate")
    p.add_argument("--new-tokens", type=int, default=4096)
    p.add_argument("--sequences", type=int, default=32, help="sequences of the concurrency run")
    p.add_argument("--room-for", type=int, default=4, help="the concurrency run's cache holds this many full sequences")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="instead: 8 requests whose prompts share this many tokens, prefix cache off and on")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.window, args.model)
    if args.shared_prefix:
        return print_shared_prefix(model, args)
    # KV bytes of one whole sequence with every page of every layer kept
    sequence_bytes = -(-(PROMPT + args.new_tokens) // PAGE) * PAGE * model.config.num_hidden_layers * 2 * 2 * 64 * 4
    rows = []
    for label, sequences, kv_bytes in (("one sequence", 1, sequence_bytes + 2**20),
                                       (f"{args.sequences} sequences, cache for {args.room_for}", args.sequences,
                                        args.room_for * sequence_bytes)):
        for reclaim in (False, True):
            log(f"--- {label}, reclaim={'on' if reclaim else 'off'}")
            r = run(model, sequences, args.new_tokens, kv_bytes, reclaim)
            rows.append([label, "on" if reclaim else "off", r["groups"], r["blocks"], r["peak_blocks"],
                         f"{r['peak_kv_mib']:.1f}", r["most_running"], r["preemptions"], r["prefill_tokens"],
                         f"{r['wall_s']:.1f}", f"{r['tok_s']:.0f}", f"{r['finished']}/{sequences}"])
    env = environment()
    print(f"{args.model}: sliding window {args.window}, {PROMPT}-token prompts + {args.new_tokens} generated, page "
          f"{PAGE}, fp32, threads={args.threads}, torch {env['torch']}, cpu flags {env['cpu_flags']}, commit "
          f"{env.get('git_commit')}")
    print(format_table(["run", "reclaim", "KV groups", "cache blocks", "peak blocks", "peak KV MiB", "most running",
                        "preemptions", "prefill tokens", "wall s", "tok/s", "finished"], rows))


def print_shared_prefix(model, args) -> None:
    runs = {caching: shared_prefix(model, 8, args.shared_prefix, args.new_tokens, caching) for caching in (False, True)}
    rows = [["on" if caching else "off", r["prefill_tokens"], r["hit_tokens"], f"{r['wall_s']:.1f}",
             f"{runs[False]['wall_s'] / r['wall_s']:.2f}x", "yes" if r["outputs"] == runs[False]["outputs"] else "no"]
            for caching, r in runs.items()]
    env = environment()
    print(f"{args.model}: sliding window {args.window}: 8 requests, {args.shared_prefix} shared + {PROMPT} own prompt "
          f"tokens, {args.new_tokens} greedy tokens each, page {PAGE}, fp32, threads={args.threads}, cpu flags "
          f"{env['cpu_flags']}, commit {env.get('git_commit')}")
    print(format_table(["prefix cache", "prefill tokens", "prefix-hit tokens", "wall s", "speed-up", "same tokens"],
                       rows))


if __name__ == "__main__":
    main()
