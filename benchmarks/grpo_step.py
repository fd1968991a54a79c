"""Seconds per GRPO step, end to end: RolloutGRPOTrainer vs TRL's GRPOTrainer with `model.generate` and with
transformers continuous batching, on the same model, data and seeds, in one invocation.

Every backend runs in its own subprocess (TRL 1.16 GRPOTrainer or our subclass, the W1 model from
benchmarks/common.py, fp32, `--prompts` prompts x `--generations` completions per step). After `--warmup` untimed
steps it times `--steps` optimizer steps; backends are interleaved over `--repeats` rounds in rotating order, and the
median step counts. Each step is split by wrapping TRL's own methods on the trainer instance (TRL is not edited):

  generation   `_generate_single_turn` (minus the weight sync it contains on our path)
  sync         our adapter's `sync_weights` (TRL's paths generate from the trained module: 0)
  old-logprob  the `_get_per_token_logps_and_entropies` call made without grad inside
               `_generate_and_score_completions` (TRL's importance-sampling recompute; ~0 when our trainer feeds it
               the engine's logprobs)
  scoring      the rest of `_generate_and_score_completions`: padding, rewards, advantages, metrics
  loss/bwd/opt the rest of the step: loss forward, backward, optimizer, logging

Two completion-length regimes, with one stop rule every backend honours the same way (TRL's EOS ids):

  uniform    the tokenizer's EOS id is one past the model's vocabulary, so nothing stops early: every completion
             runs to max_completion_length
  longtail   `k` of the model's 4096 ids are EOS (model.generation_config.eos_token_id), `k` chosen so that a
             random-weight policy (near-uniform next-token distribution) stops with median length `--median-length`:
             geometric lengths, capped at max_completion_length. EOS ids are the only stop rule all three TRL
             paths apply alike (TRL does not pass a tokenizer to `generate`, so no stop strings), and a random
             policy carries no prompt or position signal to shape lengths further: the tail is geometric, not
             lognormal, but every batch mixes short completions with a few that run to the cap

Colocated (the only regime here, and the default of RolloutGRPOTrainer): trainer and engine share one process and the
same `--threads` cores. They never run at the same time (generation, then scoring and the update), so each phase gets
every core, and the engine steps in the trainer's own thread (the manager's `stepping_in_caller`): one OpenMP team
in the process, so libgomp keeps spin-waiting between parallel regions instead of sleeping and waking its workers.
The `engine CPU` column is the CPU time of threads the engine started (its loop thread and any OpenMP team of its
own) while the trainer computes: ~0 means they sleep instead of spinning.

    python benchmarks/grpo_step.py                                    # both regimes, 3 backends (~7 min, 2 cores)
    python benchmarks/grpo_step.py --steps 2 --repeats 2              # two interleaved rounds (~11 min)
    python benchmarks/grpo_step.py --smoke                            # < 2 minutes: tiny shapes, 1 step each
    python benchmarks/grpo_step.py --regimes uniform --steps 3 --repeats 2 --backends rollout,generate
    python benchmarks/grpo_step.py --backends rollout,rollout_recompute,rollout_untrimmed  # what each change buys
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    MODEL_CONFIG,
    LoadMonitor,
    build_model,
    build_w1,
    environment,
    format_table,
    git_state,
    ids_as_text,
    log,
    run_json_child,
    word_tokenizer,
)

BACKENDS = {
    "rollout": "RolloutGRPOTrainer (rollout engine, rollout_old_logprobs='auto')",
    "rollout_recompute": "RolloutGRPOTrainer with rollout_old_logprobs='recompute' (TRL recomputes old logprobs)",
    "rollout_untrimmed": "RolloutGRPOTrainer with rollout_trim_padding=False (TRL's padded loss forward)",
    "rollout_async1": "AsyncRolloutGRPOTrainer, rollout_max_staleness=1 (engine and trainer one core each)",
    "rollout_async2": "AsyncRolloutGRPOTrainer, rollout_max_staleness=2 (engine and trainer one core each)",
    "generate": "GRPOTrainer, default path (model.generate)",
    "trl_cb": "GRPOTrainer, use_transformers_continuous_batching=True",
}
TRL_BACKENDS = ("generate", "trl_cb")
DEFAULT_BACKENDS = "rollout,generate,trl_cb"
REGIMES = ("uniform", "longtail")
TARGET_RATIO = 0.7
VOCAB = MODEL_CONFIG["vocab_size"]


# ============================================================================================== the task (children)
def stop_ids(median_length: float) -> list[int]:
    """The k highest ids as EOS: a near-uniform policy then stops each token with p = k / VOCAB (median ~ ln2 / p)."""
    p = 1.0 - 0.5 ** (1.0 / median_length)
    k = max(1, round(p * VOCAB))
    return list(range(VOCAB - k, VOCAB))


def prompt_texts(count: int, seed: int) -> list[str]:
    """W1's prompts (16-125 random ids), cycled to `count`, as text the tokenizer maps back to the same ids."""
    prompts = build_w1(1.0, seed=seed).prompts
    return [ids_as_text(prompts[i % len(prompts)]) for i in range(count)]


def reward_multiple_of_8(completions, completion_ids=None, **kwargs) -> list[float]:
    """Fraction of completion tokens whose id is a multiple of 8 (cheap, and varies within a group)."""
    return [sum(1 for t in ids if t % 8 == 0) / max(1, len(ids)) for ids in completion_ids]


# ------------------------------------------------------------------------------------------------- step timers
def _thread_cpu() -> dict[int, float]:
    """CPU seconds per thread of this process, from /proc (Linux); {} elsewhere."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def _process_cpu() -> float:
    t = os.times()
    return t.user + t.system


class StepTimers:
    """Wraps TRL's methods on one trainer instance and accumulates, per optimizer step, the phases of the docstring.

    Threads present when `baseline_threads()` is called (the main thread and its OpenMP team) are the trainer's; CPU
    time of threads that appear later (an engine loop and its OpenMP team) is counted while the trainer computes.
    """

    def __init__(self, trainer) -> None:
        import torch

        self.torch = torch
        self.trainer = trainer
        self.steps: list[dict] = []
        self._cur = self._blank()
        self._in_score = False
        self._old_seen = False
        self._gen_end: float | None = None
        self._gen_end_threads: dict[int, float] = {}
        self._base_tids: set[int] = set()
        self._last_end = time.perf_counter()
        self._last_cpu = _process_cpu()
        self._wrap("_generate_single_turn", "generation")
        self._wrap("_generate_and_score_completions", "score_total", scope=True)
        self._wrap_logps()
        gen = getattr(trainer, "vllm_generation", None)
        if gen is not None and hasattr(gen, "sync_weights"):
            original = gen.sync_weights

            def sync_weights(*a, **k):
                t = time.perf_counter()
                try:
                    return original(*a, **k)
                finally:
                    self._cur["sync"] += time.perf_counter() - t

            gen.sync_weights = sync_weights

    @staticmethod
    def _blank() -> dict:
        return dict(generation=0.0, sync=0.0, old_logprob=0.0, other_logprob=0.0, score_total=0.0,
                    generation_cpu=0.0, engine_cpu_in_trainer=0.0, trainer_cpu_in_generation=0.0)

    def baseline_threads(self) -> None:
        """Record the trainer's threads; a parallel op first, so the main thread's OpenMP team exists."""
        a = self.torch.randn(256, 256)
        (a @ a).sum()
        self._base_tids = set(_thread_cpu())

    def _wrap(self, name: str, key: str, scope: bool = False) -> None:
        original = getattr(self.trainer, name)

        def wrapper(*a, **k):
            t, cpu = time.perf_counter(), _process_cpu()
            threads = _thread_cpu() if key == "generation" else {}
            if scope:
                self._in_score, self._old_seen = True, False
            try:
                return original(*a, **k)
            finally:
                now = time.perf_counter()
                self._cur[key] += now - t
                if scope:
                    self._in_score = False
                if key == "generation":
                    self._cur["generation_cpu"] += _process_cpu() - cpu
                    self._gen_end, self._gen_end_threads = now, _thread_cpu()
                    self._cur["trainer_cpu_in_generation"] += sum(
                        v - threads.get(tid, 0.0) for tid, v in self._gen_end_threads.items() if tid in self._base_tids)

        setattr(self.trainer, name, wrapper)

    def _wrap_logps(self) -> None:
        original = self.trainer._get_per_token_logps_and_entropies

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                if self._in_score and not self.torch.is_grad_enabled():
                    key = "other_logprob" if self._old_seen else "old_logprob"
                    self._old_seen = True
                    self._cur[key] += time.perf_counter() - t

        self.trainer._get_per_token_logps_and_entropies = wrapper

    def step_end(self, step: int) -> None:
        now, cpu = time.perf_counter(), _process_cpu()
        cur = self._cur
        if self._gen_end is not None and self._base_tids:
            after = _thread_cpu()
            cur["engine_cpu_in_trainer"] = sum(v - self._gen_end_threads.get(tid, 0.0) for tid, v in after.items()
                                               if tid not in self._base_tids)
        wall = now - self._last_end
        gen = cur["generation"] - cur["sync"]
        rest = wall - cur["generation"] - cur["old_logprob"]
        cur.update(step=step, wall=wall, cpu=cpu - self._last_cpu, generation=gen,
                   scoring=cur["score_total"] - cur["generation"]
                   - cur["old_logprob"] - cur["other_logprob"],
                   loss_bwd_opt=wall - cur["score_total"], rest=rest,
                   rest_cpu_util=(cpu - self._last_cpu - cur["generation_cpu"]) / max(rest, 1e-9),
                   gen_cpu_util=cur["generation_cpu"] / max(cur["generation"], 1e-9))
        self.steps.append(cur)
        self._cur = self._blank()
        self._gen_end = None
        self._last_end, self._last_cpu = now, cpu


def make_callback(timers: StepTimers):
    from transformers import TrainerCallback

    class _StepEnd(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            timers._last_end, timers._last_cpu = time.perf_counter(), _process_cpu()
            return control

        def on_step_end(self, args, state, control, **kwargs):
            timers.step_end(state.global_step)
            return control

    return _StepEnd()


# ------------------------------------------------------------------------------------------------------ children
def child_main(args) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed-argument notices

    torch.set_num_threads(args.threads)
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    backend, regime = args.worker, args.regime
    code = git_state()
    model = build_model("float32", seed=0)
    model.requires_grad_(True)
    tok = word_tokenizer()  # EOS one past the vocabulary
    model.generation_config.eos_token_id = stop_ids(args.median_length) if regime == "longtail" else None
    model.generation_config.pad_token_id = tok.pad_token_id
    total_steps = args.warmup + args.steps
    batch = args.prompts * args.generations
    dataset = Dataset.from_dict({"prompt": prompt_texts(args.prompts * total_steps, args.seed)})
    output_dir = tempfile.mkdtemp(prefix="grpo_step_")  # TRL wants one; nothing is saved (removed at the end)
    config = dict(output_dir=output_dir, use_cpu=True, bf16=False,
                  per_device_train_batch_size=batch, num_generations=args.generations,
                  max_completion_length=args.max_completion_length, max_steps=total_steps, logging_steps=1,
                  report_to="none", save_strategy="no", learning_rate=args.learning_rate, seed=args.seed,
                  disable_tqdm=True, temperature=1.0, top_k=0, top_p=1.0, beta=0.0, dataloader_num_workers=0)
    if backend == "trl_cb":
        config["use_transformers_continuous_batching"] = True
    kwargs = dict(model=model, reward_funcs=reward_multiple_of_8, args=GRPOConfig(**config), train_dataset=dataset,
                  processing_class=tok)
    if backend.startswith("rollout_async"):
        from rollout import ContinuousBatchingConfig
        from trainer_hooks import AsyncRolloutGRPOTrainer

        trainer = AsyncRolloutGRPOTrainer(**kwargs, rollout_config=ContinuousBatchingConfig(page_size=args.page_size),
                                          rollout_max_staleness=int(backend[-1]))
    elif backend.startswith("rollout"):
        from rollout import ContinuousBatchingConfig
        from trainer_hooks import RolloutGRPOTrainer

        mode = "recompute" if backend == "rollout_recompute" else args.rollout_old_logprobs
        trainer = RolloutGRPOTrainer(**kwargs, rollout_config=ContinuousBatchingConfig(page_size=args.page_size),
                                     rollout_old_logprobs=mode,
                                     rollout_trim_padding=False if backend == "rollout_untrimmed" else None)
    else:
        trainer = GRPOTrainer(**kwargs)
    timers = StepTimers(trainer)
    trainer.add_callback(make_callback(timers))
    timers.baseline_threads()
    log(f"{backend}/{regime}: {args.warmup} warm-up + {args.steps} timed steps of {args.prompts} prompts x "
        f"{args.generations} completions, max {args.max_completion_length} tokens")
    with LoadMonitor() as monitor:
        trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    steps = []
    for rec in timers.steps:
        entry = logs.get(rec["step"], {})
        steps.append({**rec, "loss": entry.get("loss"), "reward": entry.get("reward"),
                      "mean_length": entry.get("completions/mean_length"),
                      "max_length": entry.get("completions/max_length"),
                      "clipped_ratio": entry.get("completions/clipped_ratio"),
                      "old_from_engine": entry.get("rollout/old_logprobs_from_engine"),
                      "trimmed": entry.get("rollout/trimmed_padding_fraction"),
                      "is_ratio_max": entry.get("sampling/importance_sampling_ratio/max")})
    gen = getattr(trainer, "rollout_generator", None)
    if gen is not None:
        gen.close()
    shutil.rmtree(output_dir, ignore_errors=True)
    result = dict(backend=backend, regime=regime, steps=steps, warmup=args.warmup, threads=torch.get_num_threads(),
                  **monitor.summary(), **code)
    Path(args.result_file).write_text(json.dumps(result))


# ============================================================================================== the parent
def child_argv(args, backend: str, regime: str, result_file: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", backend, "--regime", regime,
            "--result-file", result_file, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--prompts", str(args.prompts), "--generations", str(args.generations),
            "--max-completion-length", str(args.max_completion_length), "--median-length", str(args.median_length),
            "--threads", str(args.threads), "--seed", str(args.seed), "--page-size", str(args.page_size),
            "--learning-rate", repr(args.learning_rate), "--rollout-old-logprobs", args.rollout_old_logprobs]


def run_child(args, backend: str, regime: str) -> dict:
    result, error, seconds = run_json_child(lambda result_file: child_argv(args, backend, regime, result_file),
                                            args.threads, args.env, args.child_timeout, WANDB_MODE="disabled")
    if result is None:
        return dict(backend=backend, regime=regime, failed=True, error=error, process_s=seconds)
    result["process_s"] = seconds
    return result


def _median(steps: list[dict], key: str) -> float | None:
    values = [s[key] for s in steps if s.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(backend: str, runs: list[dict]) -> dict:
    ok = [r for r in runs if not r.get("failed")]
    if not ok:
        return dict(backend=backend, failed=True, error=runs[-1].get("error", "no run"))
    steps = [s for r in ok for s in r["steps"][r["warmup"]:]]
    out = dict(backend=backend, timed_steps=len(steps), runs=len(runs), failed_runs=len(runs) - len(ok))
    for key in ("wall", "cpu", "generation", "sync", "old_logprob", "scoring", "loss_bwd_opt", "rest", "rest_cpu_util",
                "engine_cpu_in_trainer", "mean_length", "max_length", "trimmed", "gen_cpu_util",
                "trainer_cpu_in_generation"):
        out[key] = _median(steps, key)
    out["all_walls"] = [round(s["wall"], 2) for s in steps]
    out["trajectories"] = [[(s["step"], s.get("loss"), s.get("reward")) for s in r["steps"]] for r in ok]
    out["old_from_engine"] = sorted({s.get("old_from_engine") for s in steps if s.get("old_from_engine") is not None})
    out["load_mean"] = max(r["load_mean"] for r in ok)
    out["cpu_util"] = min(r["cpu_util"] for r in ok)
    out["code"] = sorted({(r.get("git_commit"), r.get("rollout_dirty")) for r in ok}, key=str)
    return out


def add_ratios(rows: list[dict]) -> float | None:
    trl = [r["wall"] for r in rows if r["backend"] in TRL_BACKENDS and not r.get("failed")]
    fastest = min(trl) if trl else None
    for r in rows:
        if not r.get("failed") and fastest:
            r["ratio"] = r["wall"] / fastest
    return fastest


def _f(value, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def print_regime(regime: str, rows: list[dict], args) -> list[str]:
    fastest = add_ratios(rows)
    headers = ["backend", "s/step", "generation s", "sync s", "old-logprob s", "rest s", "(scoring s",
               "loss/bwd/opt s)", "ratio vs fastest TRL", "CPU s/step", "rest CPU util", "engine CPU in trainer s",
               "mean len", "steps", "all s/step"]
    table = []
    for r in rows:
        if r.get("failed"):
            table.append([r["backend"], "FAILED", *["-"] * 12, r["error"]])
            continue
        table.append([r["backend"], _f(r["wall"]), _f(r["generation"]), _f(r["sync"], ".3f"),
                      _f(r["old_logprob"]), _f(r["rest"]), _f(r["scoring"]), _f(r["loss_bwd_opt"]),
                      _f(r.get("ratio"), ".2f") + "x" if r.get("ratio") else "-", _f(r["cpu"], ".1f"),
                      _f(r["rest_cpu_util"]), _f(r["engine_cpu_in_trainer"], ".3f"), _f(r["mean_length"], ".1f"),
                      r["timed_steps"], "/".join(str(w) for w in r["all_walls"])])
    print(f"\n== regime {regime}: {REGIME_TEXT[regime](args)}")
    print(format_table(headers, table))
    lines = []
    ours = next((r for r in rows if r["backend"] == "rollout" and not r.get("failed")), None)
    if ours is not None and fastest:
        ok = ours["ratio"] <= TARGET_RATIO
        best = min((r for r in rows if r["backend"] in TRL_BACKENDS and not r.get("failed")), key=lambda r: r["wall"])
        lines.append(f"target ({regime}): RolloutGRPOTrainer <= {TARGET_RATIO}x the s/step of TRL's fastest path "
                     f"({best['backend']}): {ours['ratio']:.2f}x [{'MET' if ok else 'not met'}]")
    if ours is not None:
        lines.append(f"cores shared: the engine's threads used {ours['engine_cpu_in_trainer']:.3f} CPU s per step "
                     f"while the trainer computed; the trainer's threads (main + its OpenMP team, sync included) "
                     f"{ours['trainer_cpu_in_generation']:.3f} CPU s while the engine generated "
                     f"(generation CPU util {ours['gen_cpu_util']:.2f} of {args.threads} threads)")
        if ours.get("trimmed") is not None:
            lines.append(f"padding our trainer's loss forward skipped: {100 * ours['trimmed']:.0f}% of the padded "
                         "batch (rollout/trimmed_padding_fraction)")
        if ours["old_from_engine"]:
            used = "engine logprobs" if ours["old_from_engine"] == [1.0] else f"mixed {ours['old_from_engine']}"
            lines.append(f"old_per_token_logps on our path: {used} (rollout/old_logprobs_from_engine)")
    print("loss / reward per step (warm-up steps marked *; each run of a backend on its own line):")
    for r in rows:
        for traj in r.get("trajectories", []):
            cells = [f"{'*' if i < args.warmup else ''}{step}: {_f(loss, '.2e')} / {_f(reward, '.4f')}"
                     for i, (step, loss, reward) in enumerate(traj)]
            print(f"  {r['backend']:<18} " + "  ".join(cells))
    for line in lines:
        print(line)
    return lines


REGIME_TEXT = {
    "uniform": lambda a: (f"EOS outside the vocabulary: every completion runs to {a.max_completion_length} tokens"),
    "longtail": lambda a: (f"{len(stop_ids(a.median_length))} of {VOCAB} ids are EOS: geometric lengths with median "
                           f"~{a.median_length:g}, capped at {a.max_completion_length}"),
}


def parent_main(args) -> None:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    bad = [b for b in backends if b not in BACKENDS] + [r for r in regimes if r not in REGIMES]
    if bad:
        raise SystemExit(f"unknown backend/regime {bad}; backends: {sorted(BACKENDS)}, regimes: {list(REGIMES)}")
    runs = {(g, b): [] for g in regimes for b in backends}
    t0 = time.perf_counter()
    with LoadMonitor(interval=5.0) as monitor:
        for rep in range(args.repeats):
            for regime in regimes:
                order = backends[rep % len(backends):] + backends[:rep % len(backends)]
                for backend in order:
                    log(f"--- {backend} / {regime} (round {rep + 1}/{args.repeats}): {BACKENDS[backend]}")
                    runs[(regime, backend)].append(run_child(args, backend, regime))
    env = environment()
    load = monitor.summary()
    print(f"GRPO step  {args.prompts} prompts x {args.generations} completions, max_completion_length "
          f"{args.max_completion_length}, fp32, {args.threads} threads, {args.warmup} warm-up + {args.steps} timed "
          f"steps x {args.repeats} rounds per backend (median step)  torch {env['torch']}  transformers "
          f"{env['transformers']}  commit {env.get('git_commit')}"
          f"{' (rollout/ has uncommitted changes)' if env.get('rollout_dirty') else ''}")
    busy = load["load_max"] > (env["cpu_count"] or 1) + 1
    print(f"colocated: trainer and engine in one process on the same {args.threads} cores, one torch intra-op pool "
          f"size ({args.threads}) for both; they alternate, so each phase has every core. Machine: {env['cpu_count']} "
          f"cores, load average during the run mean {load['load_mean']:.1f}, max {load['load_max']:.1f}"
          f"{' (BUSY: other processes took cores, numbers inflated)' if busy else ''}"
          f"; wall {time.perf_counter() - t0:.0f}s")
    report = dict(args=vars(args), env=env, load=load, regimes={})
    targets = []
    for regime in regimes:
        rows = [summarize(b, runs[(regime, b)]) for b in backends]
        targets += print_regime(regime, rows, args)
        report["regimes"][regime] = rows
    print("\ns/step = median wall time between optimizer-step ends; rest = s/step - generation - sync - old-logprob "
          "= scoring + loss/backward/optimizer; CPU s/step = process CPU seconds per step; rest CPU util = process "
          "CPU s / wall s outside generation (about --threads when the trainer had the cores); engine CPU in trainer "
          "= CPU s per step of threads started after the trainer was built (engine loop and its OpenMP team) while "
          "the trainer computed")
    report["targets"] = targets
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))


# ============================================================================================================== CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(BACKENDS)} (default {DEFAULT_BACKENDS}; --smoke: "
                        "rollout,generate)")
    p.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated subset of uniform,longtail")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per run (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs per backend (default 1)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--median-length", type=float, default=32.0, help="median completion length in longtail")
    p.add_argument("--scale", type=float, default=None,
                   help="shrink the step: prompts x scale (>= 1) and max_completion_length x scale (>= 8)")
    p.add_argument("--smoke", action="store_true",
                   help="a quick check of the harness (< 2 min): --scale 0.25 --steps 1 --warmup 1, 2 backends")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--page-size", type=int, default=32, help="our engine's KV page size (default 32)")
    p.add_argument("--rollout-old-logprobs", default="auto", choices=["auto", "engine", "recompute"],
                   help="RolloutGRPOTrainer's rollout_old_logprobs for the 'rollout' backend")
    p.add_argument("--child-timeout", type=float, default=3600)
    p.add_argument("--env", action="append", metavar="KEY=VALUE", help="extra environment for every backend")
    p.add_argument("--output", help="also write the JSON report here")
    p.add_argument("--worker", choices=sorted(BACKENDS), help=argparse.SUPPRESS)
    p.add_argument("--regime", choices=REGIMES, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.scale = args.scale or 0.25
        args.steps, args.warmup = 1, 1
        args.backends = args.backends or "rollout,generate"
    args.backends = args.backends or DEFAULT_BACKENDS
    if args.scale is not None and not args.worker:
        args.prompts = max(1, round(args.prompts * args.scale))
        args.max_completion_length = max(8, round(args.max_completion_length * args.scale))
        args.median_length = max(2.0, args.median_length * args.scale)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
