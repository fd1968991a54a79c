"""Multi-turn episodes on the W1 model: `run_episodes` (KV kept across turns) vs re-submitting the conversation as a
new prompt every turn.

    python benchmarks/episodes.py [--episodes 64] [--turns 4] [--threads 2] [--repeats 2]

Every system plays the same episodes: prompts of --prompt-len tokens, --turn-tokens generated per model turn (EOS
ignored, so lengths match), and an environment that appends --env-tokens fixed tokens after each turn (instant, or
--env-ms of latency per call). The re-submission systems run turn by turn: all episodes' conversations so far as one
batch of new prompts (the engine's n=1 generate), with the prefix cache (page-granular reuse) and without it. The
prefill counts come from the engine's counters; read the time ratios of one invocation.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import build_model, format_table

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from rollout.rl.agents import EnvResponse


class FixedEnv:
    """Appends the same pseudo-random tokens for (episode, turn) in every system."""

    def __init__(self, tokens: int, vocab: int, latency_s: float) -> None:
        self.tokens, self.vocab, self.latency_s = tokens, vocab, latency_s

    def appended(self, episode: int, turn: int) -> list[int]:
        rng = random.Random(episode * 1000 + turn)
        return [rng.randrange(1, self.vocab) for _ in range(self.tokens)]

    def step(self, turn) -> EnvResponse:
        if self.latency_s:
            time.sleep(self.latency_s)
        return EnvResponse(token_ids=self.appended(turn.episode, turn.turn))


def episodes(gen: RolloutGenerator, prompts, env: FixedEnv, turns: int, params: SamplingParams) -> dict:
    """The episode API: turns interleave, each turn prefills only what it appended."""
    batch = gen.run_episodes(prompts, env, sampling_params=params, max_turns=turns, env_workers=len(prompts))
    assert all(e.finish_reason == "max_turns" and len(e.turns) == turns for e in batch.episodes)
    return batch.stats


def resubmitted(gen: RolloutGenerator, prompts, env: FixedEnv, turns: int, params: SamplingParams) -> dict:
    """Turn by turn, every conversation so far submitted as a new prompt (environment calls in between, serially)."""
    conversations = [list(p) for p in prompts]
    before = gen.stats()
    start = time.perf_counter()
    for turn in range(turns):
        batch = gen.generate(conversations, sampling_params=params.with_overrides(seed=turn))
        for i, sample in enumerate(batch.samples):
            conversations[i] += sample.completion_ids
            if turn + 1 < turns:
                if env.latency_s:
                    time.sleep(env.latency_s)
                conversations[i] += env.appended(i, turn)
    stats = gen.stats().since(before).as_dict()
    stats["seconds"] = time.perf_counter() - start
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--env-tokens", type=int, default=32)
    parser.add_argument("--env-ms", type=float, default=0.0, help="latency of each environment call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.episodes)]
    env = FixedEnv(args.env_tokens, vocab, args.env_ms / 1000)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.turn_tokens, ignore_eos=True, seed=0)
    cached = RolloutGenerator(model, continuous_batching_config=ContinuousBatchingConfig(page_size=32),
                              share_weights=True)
    uncached = RolloutGenerator(model, continuous_batching_config=ContinuousBatchingConfig(
        page_size=32, allow_block_sharing=False), share_weights=True)
    systems = [("run_episodes (KV kept across turns)", lambda: episodes(cached, prompts, env, args.turns, params)),
               ("re-submitted, prefix cache on", lambda: resubmitted(cached, prompts, env, args.turns, params)),
               ("re-submitted, prefix cache off", lambda: resubmitted(uncached, prompts, env, args.turns, params))]
    runs: list[list[dict]] = [[] for _ in systems]
    for _ in range(args.repeats):  # interleaved, so load drift hits every system alike
        for i, (_, run) in enumerate(systems):
            cached.manager.engine.reset_prefix_cache()
            runs[i].append(run())
    base = statistics.median(r["seconds"] for r in runs[0])
    rows = []
    for (name, _), stats in zip(systems, runs, strict=True):
        seconds = statistics.median(r["seconds"] for r in stats)
        last = stats[-1]
        rows.append([name, f"{seconds:.2f}", " / ".join(f"{r['seconds']:.1f}" for r in stats),
                     f"{seconds / base:.2f}", str(last["prefill_tokens"]),
                     f"{last['prefill_tokens'] / args.episodes:.0f}", str(last["decode_tokens"]),
                     str(last["prefix_hit_tokens"])])
    final = args.prompt_len + args.turns * args.turn_tokens + (args.turns - 1) * args.env_tokens
    print(f"W1 model, {args.threads} threads: {args.episodes} episodes x {args.turns} turns, prompt {args.prompt_len}, "
          f"{args.turn_tokens} tokens per turn, {args.env_tokens} appended per answer ({args.env_ms:g} ms); final "
          f"sequence {final} tokens; median of {args.repeats}\n")
    print(format_table(["system", "s", "runs", "x episodes", "prefill tokens", "per episode", "decode tokens",
                        "prefix-hit tokens"], rows))
    cached.close()
    uncached.close()


if __name__ == "__main__":
    main()
