"""`rollout demo`: GRPO with RolloutGRPOTrainer on the embedded tiny policy; the reward should visibly rise.

Defaults fit a laptop CPU (a few minutes on 2 cores). `--model`, `--dataset`, `--steps` and the sampling options
point the same command at any causal LM and any dataset with prompt and answer columns.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from rollout.loading import DEFAULT_MODEL, check_model, load_model, require_extra

logger = logging.getLogger(__name__)

# The only thing a --model error message can suggest besides a valid directory.
MODEL_ALTERNATIVE = "omit --model to use the embedded policy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (imports nothing heavy, so `rollout --help` stays fast)."""
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="local model directory (with config.json) or "
                        "hub id (default: the embedded policy)")
    parser.add_argument("--dataset", default=None, help="dataset name or path with prompt/answer columns "
                        "(default: the built-in two-digit addition task)")
    parser.add_argument("--split", default="train", help="dataset split to train on")
    parser.add_argument("--prompt-column", default="prompt", help="dataset column with the prompts")
    parser.add_argument("--answer-column", default="answer", help="dataset column with the reference answers")
    parser.add_argument("--reward", choices=["exact", "contains"], default="exact",
                        help="exact: the stripped completion equals the answer; contains: the answer appears in it")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--prompts-per-step", type=int, default=16, help="prompts per optimizer step")
    parser.add_argument("--num-generations", type=int, default=8, help="GRPO group size (completions per prompt)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="optimizer learning rate")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    parser.add_argument("--max-completion-length", type=int, default=8, help="tokens per completion, at most")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out prompts for before/after accuracy")
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per eval prompt")
    parser.add_argument("--output-dir", default="rollout-demo", help="where summary.json and the reward plot go")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, sampling and training")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads on CPU")
    parser.add_argument("--page-size", type=int, default=16, help="KV cache page size (tokens per block)")
    parser.add_argument("--share-weights", action="store_true", help="generate from the trained module itself")
    parser.add_argument("--no-wandb", action="store_true", help="do not log to W&B (default: offline unless logged in)")
    parser.add_argument("--async", dest="async_mode", action="store_true", help="train with a plain loop fed by "
                        "AsyncRollouts: generation runs ahead of the optimizer (rollout.demo.async_grpo)")
    parser.add_argument("--max-staleness", type=int, default=1, help="with --async: weight versions a sample may "
                        "lag the trainer (0: synchronous)")
    parser.add_argument("--engine-threads", type=int, default=None, help="with --async: intra-op threads of the "
                        "engine; the trainer gets the rest of --threads (default: half each)")


# ----------------------------------------------------------------------------------------------------- data
def _load_data(args):
    """(train dataset, eval prompts, eval answers)."""
    if args.dataset is None:
        from rollout.demo import task

        rows = task.eval_prompts()[:args.eval_size]
        train = task.make_dataset(max(4096, args.steps * args.prompts_per_step), seed=args.seed)
        return train, [r["prompt"] for r in rows], [r["answer"] for r in rows]
    from datasets import load_dataset

    data = load_dataset(args.dataset, split=args.split)
    for column in (args.prompt_column, args.answer_column):
        if column not in data.column_names:
            raise SystemExit(f"dataset {args.dataset!r} has no column {column!r} (columns: {data.column_names}); "
                             "pass --prompt-column/--answer-column")
    data = data.rename_columns({args.prompt_column: "prompt", args.answer_column: "answer"})
    data = data.map(lambda row: {"answer": str(row["answer"])})
    split = data.train_test_split(test_size=min(args.eval_size, len(data) // 5), seed=args.seed)
    return split["train"], split["test"]["prompt"], split["test"]["answer"]


def make_reward(kind: str):
    from rollout.demo import task

    if kind == "exact":
        return task.reward

    def contains(completions, answer, **kwargs):
        return [1.0 if str(a).strip() in task.parse_answer(c) else 0.0 for c, a in zip(completions, answer)]

    return contains


# ------------------------------------------------------------------------------------------------- evaluation
def evaluate(generator, prompts, answers, args, reward_fn, greedy: bool = False) -> float:
    """Mean reward on held-out prompts: sampled with the training settings, or greedy."""
    from rollout import SamplingParams

    params = SamplingParams(temperature=0.0 if greedy else args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_completion_length, seed=args.seed + 777, do_sample=not greedy)
    n = 1 if greedy else args.eval_samples
    batch = generator.generate(list(prompts), n=n, sampling_params=params)
    texts = [s.text for s in batch.samples]
    rewards = reward_fn(completions=texts, answer=[a for a in answers for _ in range(n)])
    return sum(rewards) / max(1, len(rewards))


# ----------------------------------------------------------------------------------------------------- report
def summarize(trainer, before: dict, after: dict, train_seconds: float) -> dict:
    logs = [h for h in trainer.state.log_history if "reward" in h]
    gen_seconds = sum(h.get("rollout/generation_seconds", 0.0) for h in logs)
    syncs = [h["rollout/weight_sync_seconds"] for h in logs if "rollout/weight_sync_seconds" in h]
    tps = [h["rollout/tokens_per_second"] for h in logs if "rollout/tokens_per_second" in h]
    return {
        "steps": len(logs),
        "reward_curve": [h["reward"] for h in logs],
        "accuracy_before": before, "accuracy_after": after,
        "rollout_tokens_per_second": sum(tps) / len(tps) if tps else 0.0,
        "generation_seconds": gen_seconds, "train_seconds": train_seconds,
        "generation_share": gen_seconds / train_seconds if train_seconds else 0.0,
        "weight_sync_seconds_mean": sum(syncs) / len(syncs) if syncs else 0.0,
        "weight_version": trainer.rollout_generator.weight_version,
    }


def plot(summary: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping the plot (pip install 'rollout[plot]')")
        return None
    curve = summary["reward_curve"]
    window = max(1, len(curve) // 10)
    smooth = [sum(curve[max(0, i - window + 1):i + 1]) / len(curve[max(0, i - window + 1):i + 1])
              for i in range(len(curve))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(curve) + 1), curve, alpha=0.35, label="batch reward")
    ax.plot(range(1, len(curve) + 1), smooth, label=f"moving mean ({window})")
    ax.axhline(summary["accuracy_before"]["sampled"], ls="--", c="gray", label="held-out accuracy before")
    ax.axhline(summary["accuracy_after"]["sampled"], ls="--", c="green", label="held-out accuracy after")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward (sampled accuracy)")
    ax.set_ylim(0, 1.02)
    ax.set_title("rollout demo: GRPO on the rollout engine")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(summary: dict, out: TextIO, summary_path: Path | None = None) -> None:
    b, a = summary["accuracy_before"], summary["accuracy_after"]
    lines = [
        "",
        "rollout demo: summary",
        f"  held-out accuracy, sampled (T={summary['temperature']:g}): {b['sampled']:.1%} -> {a['sampled']:.1%}",
        f"  held-out accuracy, greedy:                {b['greedy']:.1%} -> {a['greedy']:.1%}",
        f"  optimizer steps: {summary['steps']}  (weight version {summary['weight_version']})",
        f"  rollout throughput: {summary['rollout_tokens_per_second']:.0f} generated tokens/s",
        f"  time: {summary['train_seconds']:.1f}s training loop, {summary['generation_share']:.0%} of it generating",
        f"  weight sync: {1000 * summary['weight_sync_seconds_mean']:.1f} ms per step (KV cache kept allocated)",
    ]
    if summary.get("plot"):
        lines.append(f"  reward curve: {summary['plot']}")
    if summary_path is not None:
        lines.append(f"  summary: {summary_path}")
    if summary.get("wandb_run_dir"):
        lines.append(f"  W&B run: {summary['wandb_run_dir']}" + (
            f"  (offline; upload with: wandb sync {summary['wandb_run_dir']})" if summary.get("wandb_offline") else ""))
    out.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------- progress
def _progress_callback():
    """A tqdm bar showing reward and rollout speed, in place of the trainer's per-step log dicts."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, desc="GRPO", unit="step")

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.bar.set_postfix(reward=f"{logs['reward']:.2f}",
                                     tok_s=f"{logs.get('rollout/tokens_per_second', 0):.0f}")

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return DemoProgress()


# -------------------------------------------------------------------------------------------------------- run
def wandb_setup(args) -> list[str]:
    if args.no_wandb:
        return []
    try:
        import wandb  # noqa: F401
    except ImportError:
        logger.warning("wandb is not installed; logging to the console only (pip install 'rollout[wandb]')")
        return []
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or "api.wandb.ai" in _netrc()
    if not logged_in:
        os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_PROJECT", "rollout-demo")
    os.environ.setdefault("WANDB_SILENT", "true")
    return ["wandb"]


def _netrc() -> str:
    try:
        return Path("~/.netrc").expanduser().read_text()
    except OSError:
        return ""


def wandb_run_dir() -> tuple[str, bool] | None:
    """(directory, offline) of the active W&B run, read before wandb.finish() forgets it; None without a run."""
    import wandb

    run = wandb.run
    if run is None:
        return None
    directory = getattr(run.settings, "sync_dir", None) or str(Path(run.dir).parent)
    return str(Path(directory).resolve()), bool(run.offline)


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> dict:
    """`rollout demo`: check `--model` and the demo extra (ModelLoadError, MissingExtraError: one line saying what to
    do) before anything heavy is imported, then `run`."""
    check_model(args.model, alternative=MODEL_ALTERNATIVE)
    require_extra("demo", "demo", ("trl",))
    return run(args, out)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> dict:
    """Train, evaluate before and after, write summary.json (and the plot), print the summary to `out`.

    A bad `--model` raises ModelLoadError (a one-line message) before anything is written.
    """
    import torch
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from rollout import ContinuousBatchingConfig
    from trainer_hooks import RolloutGRPOTrainer

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    model, tokenizer = load_model(args.model, dtype, alternative=MODEL_ALTERNATIVE)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    report_to = wandb_setup(args)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train, eval_prompts, eval_answers = _load_data(args)
    reward_fn = make_reward(args.reward)

    config = GRPOConfig(
        output_dir=str(output_dir), use_cpu=not cuda, bf16=dtype == torch.bfloat16, seed=args.seed,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_steps=args.steps, learning_rate=args.learning_rate, lr_scheduler_type="constant", beta=0.0,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, logging_steps=1,
        report_to=report_to, run_name="rollout-demo", save_strategy="no", disable_tqdm=True,
    )
    trainer = RolloutGRPOTrainer(
        model=model, reward_funcs=reward_fn, args=config, train_dataset=train, processing_class=tokenizer,
        rollout_config=ContinuousBatchingConfig(page_size=args.page_size), share_weights=args.share_weights,
        callbacks=[_progress_callback()])
    trainer.remove_callback(PrinterCallback)  # the bar shows reward and speed; W&B gets every metric
    generator = trainer.rollout_generator
    before = {"sampled": evaluate(generator, eval_prompts, eval_answers, args, reward_fn),
              "greedy": evaluate(generator, eval_prompts, eval_answers, args, reward_fn, greedy=True)}
    logger.info("before training: sampled accuracy %.1f%%, greedy %.1f%%", 100 * before["sampled"],
                100 * before["greedy"])
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    trainer.vllm_generation.sync_weights()  # the last optimizer step's weights
    after = {"sampled": evaluate(generator, eval_prompts, eval_answers, args, reward_fn),
             "greedy": evaluate(generator, eval_prompts, eval_answers, args, reward_fn, greedy=True)}
    summary = summarize(trainer, before, after, train_seconds)
    summary["temperature"] = args.temperature
    summary["plot"] = str(plot(summary, output_dir / "reward_curve.png") or "")
    wandb_run = wandb_run_dir() if "wandb" in report_to else None
    if wandb_run is not None:
        summary["wandb_run_dir"], summary["wandb_offline"] = wandb_run
    summary_path = output_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2))
    if wandb_run is not None:
        import wandb

        wandb.run.summary.update({"accuracy_before": before["sampled"], "accuracy_after": after["sampled"]})
        wandb.finish()
    generator.close()
    report(summary, out, summary_path)
    return summary
