"""Steps of a few rows on CPU: `F.linear` (MKL) vs the engine's oneDNN-packed copies vs MKL's packed copies vs the
small-rows C kernel (csrc/small_matmul.c): what the timed choice of rollout/engine/cpu/linear_timing.py rests on
(SMALL_MATMUL_ROWS in features.py); benchmarks/linear_backends.py compares the two packed copies at every row count.

1. One pass over all of W1's linear weights (8 layers and the lm_head, distinct tensors: ~103 MB, more than a last-level
   cache, as in a decode step) at 1-16 rows, with each kernel, alternated, best of `--rounds`.
2. The engine itself: greedy requests of `--new-tokens` tokens, 1, 2, 4 and 8 at once (that many rows per decode
   step), with oneDNN's packed copies at every size, with `F.linear` up to `--limit` rows, with the vendor rule the
   engine had before its choice was timed (`F.linear` at 1-2 rows, the small-rows kernel at 3-8 on AVX-512 builds),
   with the small-rows kernel at 1-8 rows, and as shipped (see the CPU line), alternated on the same engine.

    python benchmarks/small_steps.py
    python benchmarks/small_steps.py --compile-level 1 --limit 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import build_model, format_table, log, seconds_per_call
from benchmarks.roofline import MATMUL_KINDS, linear_shapes, matmul_fn

KINDS = (*MATMUL_KINDS, "small_matmul")


def _calls(kind: str, inputs: dict, weights: list):
    if kind != "small_matmul":
        return [matmul_fn(kind, inputs[w.shape[1]], w) for w in weights]
    from rollout.engine.cpu.kernel import load_kernel
    from rollout.engine.cpu.matmuls import small_matmul

    if load_kernel() is None:
        return [None]
    return [lambda x=inputs[w.shape[1]], w=w: small_matmul(x, w, None) for w in weights]


def linear_pass_rows(rounds: int) -> list[list]:
    weights = [torch.randn(fan_out, fan_in) for _, fan_in, fan_out, count in linear_shapes() for _ in range(count)]
    megabytes = sum(w.numel() for w in weights) * 4 / 1e6
    rows_out = []
    for rows in (1, 2, 3, 4, 8, 12, 16):
        inputs = {width: torch.randn(rows, width) for width in {w.shape[1] for w in weights}}
        passes = {}
        for kind in KINDS:  # F.linear, the packed copies (packed here, outside the timing), the C kernel
            calls = _calls(kind, inputs, weights)
            if None in calls:
                if kind == "onednn_packed":
                    raise SystemExit("this torch cannot pack fp32 linear weights (no oneDNN): nothing to compare")
                continue  # no C compiler (no kernel column), no MKL packed sgemm
            passes[kind] = lambda calls=calls: [call() for call in calls]
        best = dict.fromkeys(passes, float("inf"))
        for _ in range(rounds):  # the kernels alternate, round by round
            for kind in passes:
                best[kind] = min(best[kind], seconds_per_call(passes[kind], 0.5))
        rows_out.append([f"linear pass, {rows} rows ({megabytes:.0f} MB of weights)",
                         *(f"{best[k] * 1e3:.2f}" if k in best else "-" for k in KINDS)])
    return rows_out


def engine_rows(args) -> list[list]:
    from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams
    from rollout.engine.cpu import kernel as cpu_kernel
    from rollout.engine.cpu.features import SMALL_MATMUL_ISAS, cpu_features

    model = build_model("float32")
    engine = LLMEngine(model, None, ContinuousBatchingConfig(default_compile_level=args.compile_level))
    linears = engine.runner.linears
    if linears is None:
        raise SystemExit("this engine does not pack its linears (no oneDNN here?)")
    shipped = (linears.mkl, linears.unpacked_max_rows, linears.small_matmul, linears.small_rows)
    # (MKL's copies?, F.linear up to this many rows, the small-rows kernel?, at which rows)
    # the vendor rule ran the kernel at 3-8 rows on AVX-512 builds only
    kernel = cpu_kernel.load_kernel() is not None
    by_rule = kernel and cpu_features().kernel.isa in SMALL_MATMUL_ISAS
    settings = {"f_linear": (False, args.limit, False, (3, 8)), "onednn_packed": (False, 0, False, (3, 8)),
                "vendor_rule": (False, 2, by_rule, (3, 8)), "kernel_1_8": (False, 0, kernel, (1, 8)),
                "shipped": shipped}
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for streams in (1, 2, 4, 8):
        prompts = [torch.randint(0, model.config.vocab_size, (64,), generator=gen).tolist() for _ in range(streams)]

        def generate(prompts=prompts):
            for prompt in prompts:
                engine.add_request(prompt, sampling_params=params)
            while engine.has_unfinished():
                engine.step()

        times: dict[str, float] = {}
        for rnd in range(args.rounds + 1):  # a warm-up round, then timed rounds
            for name, (mkl, limit, small, small_rows) in settings.items():
                if linears.mkl != mkl:
                    linears.use_mkl(mkl)
                linears.unpacked_max_rows, linears.small_matmul, linears.small_rows = limit, small, small_rows
                start = time.perf_counter()
                generate()
                if rnd:
                    times[name] = min(times.get(name, float("inf")), time.perf_counter() - start)
        linears.use_mkl(shipped[0])
        ms = {name: seconds / args.new_tokens * 1e3 for name, seconds in times.items()}
        out.append([f"{streams} row(s), level {args.compile_level}", *(f"{ms[name]:.2f}" for name in settings),
                    f"{ms['vendor_rule'] / ms['shipped']:.2f}x", f"{ms['onednn_packed'] / ms['shipped']:.2f}x"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-level", type=int, default=1)
    parser.add_argument("--limit", type=int, default=8, help="F.linear up to this many rows in the engine rows")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from rollout.engine.cpu.features import cpu_features

    log(f"CPU: {cpu_features().describe()}")
    print(format_table(["measure (fp32)", "F.linear ms", "oneDNN packed ms", "MKL packed ms",
                        "small-rows kernel ms"], linear_pass_rows(args.rounds)))
    print(format_table(["engine decode step (fp32, ms)", f"F.linear up to {args.limit} rows", "oneDNN packed",
                        "vendor rule", "kernel at 1-8 rows", "as shipped", "vendor rule / shipped",
                        "packed / shipped"],
                       engine_rows(args)))


if __name__ == "__main__":
    main()
