"""`rollout demo --async`: the same GRPO task as the demo, as a plain loop fed by `AsyncRollouts`.

The engine generates the next batches while the optimizer steps: every optimizer step takes the next scored groups,
trains on them with the decoupled-PPO correction (`rollout.rl.losses`), and pushes the new weights into the running
engine without waiting for generation. On a CPU the engine's loop thread and the trainer each get their own cores
(`--engine-threads`, the rest for the trainer).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
from tqdm.auto import tqdm

from rollout import AsyncRollouts, ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from rollout.demo import task
from rollout.demo.run import MODEL_ALTERNATIVE, evaluate, make_reward, plot, wandb_run_dir, wandb_setup
from rollout.loading import load_model
from rollout.rl.losses import completion_logprobs, decoupled_grpo_loss, group_advantages
from rollout.thread_teams import split_threads
from trainer_hooks.metrics import log_to_wandb

logger = logging.getLogger(__name__)


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> dict:
    """`rollout demo --async`: train, write summary.json and the reward plot, print the summary to `out`."""
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    report_to = wandb_setup(args)
    if "wandb" in report_to:
        import wandb

        wandb.init(name="rollout-demo-async", config={k: v for k, v in vars(args).items() if k != "func"})
    summary = train(args, out)
    summary["plot"] = str(plot(summary, output_dir / "reward_curve.png") or "")
    run_dir = wandb_run_dir() if "wandb" in report_to else None
    if run_dir is not None:
        import wandb

        summary["wandb_run_dir"], summary["wandb_offline"] = run_dir
        wandb.run.summary.update({"accuracy_before": summary["accuracy_before"]["sampled"],
                                  "accuracy_after": summary["accuracy_after"]["sampled"]})
        wandb.finish()
    summary_path = output_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2))
    report(summary, out)
    out.write(f"  summary: {summary_path}\n")
    if summary.get("wandb_run_dir"):
        offline = summary.get("wandb_offline")
        out.write(f"  W&B run: {summary['wandb_run_dir']}" + (
            f"  (offline; upload with: wandb sync {summary['wandb_run_dir']})" if offline else "") + "\n")
    return summary


def train(args: argparse.Namespace, out: TextIO = sys.stdout) -> dict:
    """Evaluate, train asynchronously for `args.steps` optimizer steps, evaluate again; returns the summary."""
    engine_threads, trainer_threads = split_threads(args.threads, getattr(args, "engine_threads", None),
                                                    "--engine-threads")
    torch.set_num_threads(trainer_threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, torch.float32, alternative=MODEL_ALTERNATIVE)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    reward_fn = make_reward(args.reward)
    rows = task.eval_prompts()[:args.eval_size]
    eval_prompts, eval_answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    generator = RolloutGenerator(model, tokenizer=tokenizer, seed=args.seed,
                                 continuous_batching_config=ContinuousBatchingConfig(page_size=args.page_size))
    before = {"sampled": evaluate(generator, eval_prompts, eval_answers, args, reward_fn),
              "greedy": evaluate(generator, eval_prompts, eval_answers, args, reward_fn, greedy=True)}
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_completion_length)
    prompts = task.make_prompts(max(4096, args.steps * args.prompts_per_step), seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    history: list[dict] = []
    start = time.perf_counter()
    with AsyncRollouts(generator, prompts, reward_fn, groups_per_batch=args.prompts_per_step,
                       n=args.num_generations, sampling_params=params, max_staleness=args.max_staleness,
                       engine_threads=engine_threads, seed=args.seed) as producer:
        bar = tqdm(total=args.steps, desc=f"async GRPO (max_staleness={args.max_staleness})", unit="step")
        for step, batch in zip(range(args.steps), producer):
            metrics = optimizer_step(model, optimizer, batch, args.temperature, tokenizer.pad_token_id)
            sync_start = time.perf_counter()
            producer.update_weights(model)
            metrics.update(batch.metrics, weight_sync_seconds=time.perf_counter() - sync_start)
            history.append(metrics)
            log_to_wandb(metrics, step=step)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward']:.2f}", behind=f"{metrics['async/versions_behind/mean']:.1f}")
        bar.close()
    train_seconds = time.perf_counter() - start
    after = {"sampled": evaluate(generator, eval_prompts, eval_answers, args, reward_fn),
             "greedy": evaluate(generator, eval_prompts, eval_answers, args, reward_fn, greedy=True)}
    summary = summarize(history, before, after, train_seconds, generator.weight_version, args)
    generator.close()
    return summary


def optimizer_step(model, optimizer, batch, temperature: float, pad_token_id: int) -> dict[str, float]:
    """One GRPO step on an AsyncBatch; returns its metrics."""
    rollouts = batch.rollouts
    tensors = rollouts.to_tensors(pad_token_id=pad_token_id)
    rewards = torch.tensor(batch.rewards)
    advantages = group_advantages(rewards, rollouts.group_sizes)
    model.train()
    logps = completion_logprobs(model, tensors, temperature)
    loss, is_stats = decoupled_grpo_loss(logps, tensors["policy_logprobs"], advantages, tensors["completion_mask"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()
    return {"reward": float(rewards.mean()), "loss": float(loss.detach()),
            **{f"async/{k}": v for k, v in is_stats.items()}}


def summarize(history: list[dict], before: dict, after: dict, train_seconds: float, version: int,
              args: argparse.Namespace) -> dict:
    def mean(key: str) -> float:
        values = [h[key] for h in history if key in h and math.isfinite(h[key])]
        return sum(values) / len(values) if values else 0.0

    return {
        "mode": "async", "max_staleness": args.max_staleness, "steps": len(history),
        "reward_curve": [h["reward"] for h in history], "accuracy_before": before, "accuracy_after": after,
        "train_seconds": train_seconds, "samples_per_second": len(history) * args.prompts_per_step
        * args.num_generations / max(train_seconds, 1e-9),
        "trainer_wait_fraction": mean("async/trainer_wait_fraction"),
        "producer_idle_fraction": mean("async/producer_idle_fraction"),
        "versions_behind_mean": mean("async/versions_behind/mean"),
        "versions_behind_max": max((h["async/versions_behind/max"] for h in history), default=0.0),
        "is_ratio_max": max((h["async/is_ratio/max"] for h in history), default=1.0),
        "clipped_fraction_mean": mean("async/clipped_fraction"),
        "weight_sync_seconds_mean": mean("weight_sync_seconds"), "weight_version": version,
        "temperature": args.temperature,
    }


def report(summary: dict, out: TextIO) -> None:
    b, a = summary["accuracy_before"], summary["accuracy_after"]
    out.write("\n".join([
        "",
        f"rollout demo --async: summary (max_staleness={summary['max_staleness']})",
        f"  held-out accuracy, sampled (T={summary['temperature']:g}): {b['sampled']:.1%} -> {a['sampled']:.1%}",
        f"  held-out accuracy, greedy:                {b['greedy']:.1%} -> {a['greedy']:.1%}",
        f"  optimizer steps: {summary['steps']}  (weight version {summary['weight_version']})",
        f"  training throughput: {summary['samples_per_second']:.1f} samples/s over {summary['train_seconds']:.1f}s",
        f"  trainer waited for rollouts {summary['trainer_wait_fraction']:.0%} of the time; the engine was idle "
        f"{summary['producer_idle_fraction']:.0%}",
        f"  samples were {summary['versions_behind_mean']:.2f} versions behind on average "
        f"(max {summary['versions_behind_max']:.0f}); IS ratio max {summary['is_ratio_max']:.2f}, "
        f"{summary['clipped_fraction_mean']:.2%} of tokens clipped",
        f"  weight sync: {1000 * summary['weight_sync_seconds_mean']:.1f} ms per step, into the running engine",
    ]) + "\n")
