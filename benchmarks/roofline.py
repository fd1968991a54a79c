"""Roofline for a model on this machine (W1's by default, or a real small-LM shape with `--model`), and our engine's
fraction of it in steady decode.

1. Matmul throughput at the model's shapes: `[tokens, in] @ [in, out]` for q, k, v, o, gate, up, down and the
   lm_head, best of several trials each, in the run's dtype, with every kernel this torch has for it: `F.linear` (MKL
   sgemm in fp32; oneDNN, with AVX512_BF16 or AMX where the CPU has them, in bf16), oneDNN on a prepacked weight, and
   MKL's packed sgemm (fp32). The ceiling uses the fastest per shape: this CPU's measured peak for that dtype at the
   model's own shapes, not the kernel we happen to beat.
2. FLOPs per token from the config: 2 x (weights of every linear layer, lm_head included) plus attention
   (QK^T and AV: 4 x heads x head_dim x context per layer) at a given context length.
3. Ceiling tokens/s = (all linear FLOPs of one forward at `--tokens` rows) / (measured time of those matmuls), per
   token. This is the ideal: every FLOP at the measured matmul rate, nothing else costs anything.
4. Our engine in steady decode: `--decode-batch` sequences, all decoding (one token each per step), timed over
   `--decode-steps` steps, as tokens/s and as a fraction of the ceiling; then the same steps with phase timers.

    python benchmarks/roofline.py                    # fp32, 2 threads
    python benchmarks/roofline.py --dtype bfloat16 --json
    python benchmarks/roofline.py --from-throughput w1.json   # also: W1 end-to-end as a fraction of the ceiling
    python benchmarks/roofline.py --model qwen3-0.6b --dtype bfloat16 --workload grpo --schedule \
        --from-throughput grpo.json --decode-batch 64   # a real shape: ceiling, schedule-aware ideal, each system
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import (
    MODEL_CONFIG,
    LoadMonitor,
    PhaseTimers,
    build_grpo,
    build_w1,
    count_params,
    environment,
    format_table,
    seconds_per_call,
    torch_dtype,
)
from benchmarks.shapes import MODEL_CHOICES, build_named, model_shape


def linear_shapes(cfg: dict = MODEL_CONFIG) -> list[tuple[str, int, int, int]]:
    """(name, in_features, out_features, how many per forward) for every linear layer of the model."""
    h, heads, kv, d, inter, layers = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                      cfg["head_dim"], cfg["intermediate_size"], cfg["num_hidden_layers"])
    return [
        ("q_proj", h, heads * d, layers),
        ("k_proj", h, kv * d, layers),
        ("v_proj", h, kv * d, layers),
        ("o_proj", heads * d, h, layers),
        ("gate_proj", h, inter, layers),
        ("up_proj", h, inter, layers),
        ("down_proj", inter, h, layers),
        ("lm_head", h, cfg["vocab_size"], 1),
    ]


def flops_per_token(context: float, cfg: dict = MODEL_CONFIG) -> dict:
    linear = sum(2 * i * o * n for _, i, o, n in linear_shapes(cfg))
    attention = 4 * cfg["num_attention_heads"] * cfg["head_dim"] * context * cfg["num_hidden_layers"]
    return dict(linear=linear, attention=attention, total=linear + attention)


MATMUL_KINDS = ("f_linear", "onednn_packed", "mkl_packed")


def matmul_fn(kind: str, x: torch.Tensor, w: torch.Tensor):
    """A call of `x @ w.T` with kernel `kind` (MATMUL_KINDS), or None where this torch cannot pack `w`'s dtype with
    that kernel (MKL's packed sgemm: fp32 only, where rollout.engine.cpu.mkl_packed finds it)."""
    if kind == "f_linear":
        return lambda: F.linear(x, w)
    if kind == "mkl_packed":
        from rollout.engine.cpu import mkl_packed

        if w.dtype != torch.float32 or not mkl_packed.available():
            return None
        packed = mkl_packed.MklPackedWeight(w)
        return lambda: packed.linear(x)
    from rollout.engine.cpu.packed_linear import PACK_BATCH_HINT, packing_available

    if not packing_available(w.dtype):
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def time_matmul(tokens: int, fan_in: int, fan_out: int, dtype: torch.dtype, min_time: float = 0.2,
                trials: int = 5, kind: str = "f_linear") -> float:
    """Best seconds per `x[tokens, in] @ W[out, in]^T` with kernel `kind` over `trials` trials of at least
    `min_time` each (inf when the kernel is unavailable)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, fan_in, generator=g).to(dtype)
    w = (torch.randn(fan_out, fan_in, generator=g) * fan_in ** -0.5).to(dtype)
    with torch.inference_mode():
        fn = matmul_fn(kind, x, w)
        if fn is None:
            return float("inf")
        for _ in range(3):
            fn()
        per_call = seconds_per_call(fn, 0.05)
        reps = max(1, int(min_time / per_call))
        best = float("inf")
        for _ in range(trials):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t) / reps)
    return best


def best_matmul(tokens: int, fan_in: int, fan_out: int, dtype: torch.dtype, min_time: float, trials: int) -> dict:
    """Seconds per matmul with each kernel, and the best of them."""
    times = {kind: time_matmul(tokens, fan_in, fan_out, dtype, min_time, trials, kind) for kind in MATMUL_KINDS}
    return dict(times, best=min(times.values()))


def measure_matmuls(tokens: int, dtype: torch.dtype, min_time: float, trials: int, cfg: dict = MODEL_CONFIG) -> dict:
    rows, total_flops = [], 0.0
    totals = dict.fromkeys((*MATMUL_KINDS, "best"), 0.0)
    for name, fan_in, fan_out, count in linear_shapes(cfg):
        sec = best_matmul(tokens, fan_in, fan_out, dtype, min_time, trials)
        flops = 2.0 * tokens * fan_in * fan_out
        rows.append(dict(name=name, shape=f"[{tokens},{fan_in}]x[{fan_in},{fan_out}]", count=count,
                         seconds=sec["best"], gflops=flops / sec["best"] / 1e9,
                         gflops_by_kind={k: flops / sec[k] / 1e9 for k in MATMUL_KINDS}))
        total_flops += flops * count
        for k in totals:
            totals[k] += sec[k] * count
    return dict(shapes=rows, forward_matmul_s=totals["best"], forward_flops=total_flops,
                gflops=total_flops / totals["best"] / 1e9,
                gflops_by_kind={k: total_flops / totals[k] / 1e9 for k in MATMUL_KINDS})


def schedule_bound(work, cfg: dict, dtype: torch.dtype, min_time: float, trials: int) -> dict:
    """Schedule-aware ideal for a workload: all sequences start together and decode until their own budget, so step s
    runs as many rows as there are sequences with max_new_tokens >= s (all of them first, a handful in the tail).
    Each step costs the measured time of all linears at that row count (log-interpolated over a sweep); the prefill
    computes each prompt once (perfect prefix sharing) at the 256-row rate. Attention, sampling and overheads cost
    nothing."""
    import numpy as np

    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    step_ms = [1e3 * sum(best_matmul(rows, i, o, dtype, min_time, trials)["best"] * n
                         for _, i, o, n in linear_shapes(cfg)) for rows in grid]
    budgets = np.array(work.max_new_tokens)
    rows_per_step = [int((budgets >= s).sum()) for s in range(1, int(budgets.max()) + 1)]
    decode_s = sum(float(np.interp(np.log2(r), np.log2(grid), step_ms)) for r in rows_per_step) / 1e3
    unique_prompt = sum(len(p) for p in work.prompts)
    linear_per_token = flops_per_token(0, cfg)["linear"]
    rate_256 = 256 * linear_per_token / (step_ms[-1] / 1e3)  # FLOP/s of all linears at 256 rows
    prefill_s = unique_prompt * linear_per_token / rate_256
    total = decode_s + prefill_s
    return dict(grid=grid, step_ms=step_ms, steps=len(rows_per_step), mean_rows=float(np.mean(rows_per_step)),
                decode_s=decode_s, prefill_s=prefill_s, unique_prompt_tokens=unique_prompt,
                requested_tokens=int(budgets.sum()), ideal_tok_s=int(budgets.sum()) / total, scale=work.scale,
                workload=work.description)


# --------------------------------------------------------------------------------------------------- steady decode
def steady_decode(model, args) -> dict:
    """`decode_batch` sequences decoding together; tokens/s over `decode_steps` all-decode steps."""
    from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams

    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    budget = args.decode_steps * 2 + args.decode_warmup + 8  # nobody finishes during the timed windows
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.decode_batch)]
    page = args.engine_page_size
    # Enough blocks for every sequence's whole life (per-sequence page rounding included): no preemption.
    blocks = args.decode_batch * -(-(args.prompt_len + budget) // page) + 8
    cfg = ContinuousBatchingConfig(page_size=page, num_blocks=blocks)
    engine = LLMEngine(model, None, cfg)
    for i, p in enumerate(prompts):
        sp = SamplingParams(seed=None if args.no_seed else i, max_new_tokens=budget, temperature=1.0, top_k=0,
                            top_p=1.0, ignore_eos=True)
        engine.add_request(p, request_id=f"d{i}", sampling_params=sp)

    t = time.perf_counter()
    while True:  # prefill everyone (chunked by the engine's token budget)
        engine.step()
        s = engine.stats()
        if s.waiting == 0 and s.generated_tokens >= args.decode_batch:
            break
    prefill_s = time.perf_counter() - t
    for _ in range(args.decode_warmup):
        engine.step()

    def timed_steps():
        before = engine.stats()
        ctx0 = args.prompt_len + before.generated_tokens / args.decode_batch
        with LoadMonitor() as mon:
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                engine.step()
            wall = time.perf_counter() - t0
        after = engine.stats()
        tokens = after.decode_tokens - before.decode_tokens
        steps = after.steps - before.steps
        ctx1 = args.prompt_len + after.generated_tokens / args.decode_batch
        return dict(wall_s=wall, tokens=tokens, steps=steps, tok_s=tokens / wall, ms_per_step=1000 * wall / steps,
                    mean_context=(ctx0 + ctx1) / 2, all_decode=tokens == steps * args.decode_batch,
                    preemptions=after.preemptions - before.preemptions, **mon.summary())

    plain = timed_steps()
    with PhaseTimers() as timers:
        phased = timed_steps()
    return dict(prefill_s=prefill_s, timed=plain, with_timers=phased, phases=timers.report(phased["wall_s"]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--model", default="w1", choices=MODEL_CHOICES,
                   help="W1's 25.7M toy model (default) or a real small-LM shape with random weights")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256, help="rows of the matmuls (tokens per forward; default 256)")
    p.add_argument("--context", type=float, default=None,
                   help="context length for attention FLOPs (default: the steady-decode run's mean context)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.2, help="seconds per matmul trial")
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=96, help="prompt length of the steady-decode sequences")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--decode-warmup", type=int, default=4)
    p.add_argument("--engine-page-size", type=int, default=32)
    p.add_argument("--no-seed", action="store_true")
    p.add_argument("--skip-engine", action="store_true", help="only the matmul roofline")
    p.add_argument("--from-throughput",
                   help="JSON written by throughput.py --output (same --model and --dtype): each system as a fraction")
    p.add_argument("--workload", default="w1", choices=["w1", "grpo"], help="the workload of --schedule")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt of --workload grpo")
    p.add_argument("--schedule", "--w1", dest="schedule", action="store_true",
                   help="also the schedule-aware ideal of --workload (matmuls timed at 1..256 rows; 30 s or more)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch_dtype(args.dtype)

    cfg = model_shape(args.model)
    with LoadMonitor() as mon:
        mm = measure_matmuls(args.tokens, dtype, args.min_time, args.trials, cfg)
    mm.update(mon.summary())
    report = dict(benchmark="roofline", model=args.model, dtype=args.dtype, threads=torch.get_num_threads(),
                  tokens=args.tokens, env=environment(), matmul=mm)

    decode = None
    if not args.skip_engine:
        model = build_named(args.model, args.dtype, seed=0)
        report["params"] = count_params(model)
        decode = steady_decode(model, args)
        report["steady_decode"] = {k: v for k, v in decode.items() if k != "phases"}
    context = args.context if args.context is not None else (
        decode["timed"]["mean_context"] if decode else args.prompt_len + args.decode_steps)
    fpt = flops_per_token(context, cfg)
    rate = mm["gflops"] * 1e9
    ceiling_linear = rate / fpt["linear"]
    ceiling_total = rate / fpt["total"]
    report.update(context=context, flops_per_token=fpt, ceiling_tok_s=ceiling_linear,
                  ceiling_with_attention_tok_s=ceiling_total,
                  ceiling_f_linear_tok_s=mm["gflops_by_kind"]["f_linear"] * 1e9 / fpt["linear"])
    if decode:
        report["engine_fraction"] = decode["timed"]["tok_s"] / ceiling_linear
        report["engine_fraction_with_attention"] = decode["timed"]["tok_s"] / ceiling_total
    if args.schedule:
        work = (build_grpo(cfg["vocab_size"], samples=args.group_size) if args.workload == "grpo"
                else build_w1(vocab_size=cfg["vocab_size"]))
        report["schedule_bound"] = schedule_bound(work, cfg, dtype, min(args.min_time, 0.1), min(args.trials, 3))
    if args.from_throughput:
        runs = json.loads(Path(args.from_throughput).read_text())
        if (runs.get("model", "w1"), runs.get("dtype")) != (args.model, args.dtype):
            raise SystemExit(f"--from-throughput {args.from_throughput} ran model {runs.get('model', 'w1')} in "
                             f"{runs.get('dtype')}; this roofline is for {args.model} in {args.dtype}")
        bound = report.get("schedule_bound", {}).get("ideal_tok_s")
        report["end_to_end"] = {
            r["system"]: dict(useful_tok_s=r["useful_tok_s"], fraction=r["useful_tok_s"] / ceiling_linear,
                              fraction_of_f_linear_ceiling=r["useful_tok_s"] / report["ceiling_f_linear_tok_s"],
                              fraction_of_schedule_bound=r["useful_tok_s"] / bound if bound else None)
            for r in runs["results"] if not r.get("failed")}

    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"roofline  model={args.model}  dtype={args.dtype}  threads={report['threads']}  torch "
          f"{report['env']['torch']}  matmul rows={args.tokens}  (matmul timing: cpu util {mm['cpu_util']:.2f}, "
          f"load {mm['load_mean']:.1f})")
    print(f"CPU flags: {report['env']['cpu_flags']}")
    rows = [[r["name"], r["shape"], r["count"], f"{r['gflops_by_kind']['f_linear']:.1f}",
             f"{r['gflops_by_kind']['onednn_packed']:.1f}", f"{r['gflops_by_kind']['mkl_packed']:.1f}",
             f"{1e3 * r['seconds']:.3f}"] for r in mm["shapes"]]
    print(format_table(["layer", "x @ W^T", "per fwd", "F.linear GFLOP/s", "oneDNN packed GFLOP/s",
                        "MKL packed GFLOP/s", "best ms"], rows))
    by_kind = mm["gflops_by_kind"]
    print(f"all linears of one forward at {args.tokens} tokens: {mm['forward_flops'] / 1e9:.2f} GFLOP in "
          f"{1e3 * mm['forward_matmul_s']:.2f} ms = {mm['gflops']:.1f} GFLOP/s with the best kernel per shape "
          f"(F.linear alone: {by_kind['f_linear']:.1f}, oneDNN packed alone: {by_kind['onednn_packed']:.1f}, MKL "
          f"packed alone: {by_kind['mkl_packed']:.1f})")
    print(f"FLOPs/token: linear {fpt['linear'] / 1e6:.2f} M (2 x {fpt['linear'] // 2:,} weights incl. lm_head), "
          f"attention {fpt['attention'] / 1e6:.2f} M at context {context:.0f}, total {fpt['total'] / 1e6:.2f} M")
    print(f"CEILING: {ceiling_linear:,.0f} tokens/s (linear FLOPs at the best measured rate); "
          f"{ceiling_total:,.0f} tokens/s counting attention FLOPs at the same rate; at the F.linear rate alone "
          f"the ceiling would be {report['ceiling_f_linear_tok_s']:,.0f} tokens/s")
    if decode:
        d = decode["timed"]
        print(f"\nour engine, steady decode: {args.decode_batch} sequences x {d['steps']} steps (prompt "
              f"{args.prompt_len}, mean context {d['mean_context']:.0f}, all-decode steps: {d['all_decode']}, "
              f"preemptions: {d['preemptions']}): "
              f"{d['tok_s']:,.1f} tokens/s, {d['ms_per_step']:.1f} ms/step "
              f"(cpu util {d['cpu_util']:.2f}, load {d['load_mean']:.1f}); prefill of the batch took "
              f"{decode['prefill_s']:.1f}s")
        print(f"ENGINE FRACTION OF CEILING: {report['engine_fraction']:.1%} "
              f"({report['engine_fraction_with_attention']:.1%} of the attention-inclusive ceiling, "
              f"{d['tok_s'] / report['ceiling_f_linear_tok_s']:.1%} of the F.linear-rate ceiling); target >= 50%")
        print(f"\nsame steps with phase timers ({decode['with_timers']['tok_s']:,.1f} tokens/s, "
              f"{decode['with_timers']['ms_per_step']:.1f} ms/step):")
        print(decode["phases"])
        ideal_ms = 1e3 * args.decode_batch / ceiling_linear
        print(f"ideal step at the ceiling: {ideal_ms:.1f} ms for {args.decode_batch} tokens")
    if "schedule_bound" in report:
        b = report["schedule_bound"]
        print(f"\n{args.workload.upper()} schedule-aware ideal: {b['ideal_tok_s']:,.0f} useful tokens/s "
              f"({b['steps']} decode steps, "
              f"{b['mean_rows']:.1f} rows/step on average: {b['decode_s']:.2f}s of matmuls; prefill of "
              f"{b['unique_prompt_tokens']:,} unique prompt tokens: {b['prefill_s']:.2f}s); all-linears ms per step "
              "at rows " + ", ".join(f"{r}: {t:.2f}" for r, t in zip(b["grid"], b["step_ms"], strict=True)))
    if "end_to_end" in report:
        for system, r in report["end_to_end"].items():
            extra = (f", {r['fraction_of_schedule_bound']:.1%} of the schedule-aware ideal"
                     if r.get("fraction_of_schedule_bound") else "")
            print(f"end-to-end {system}: {r['useful_tok_s']:.1f} useful tokens/s = {r['fraction']:.1%} "
                  f"of the ceiling ({r['fraction_of_f_linear_ceiling']:.1%} of the F.linear-rate ceiling){extra}")
    load = max([mm["load_mean"]] + ([decode["timed"]["load_mean"]] if decode else []))
    if load > (report["env"]["cpu_count"] or 1) + 0.5:
        print(f"WARNING: load average {load:.1f} above the core count: other processes shared the cores; rerun")


if __name__ == "__main__":
    main()
