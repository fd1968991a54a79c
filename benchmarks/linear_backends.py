"""fp32 linears on MKL's packed copies vs oneDNN's, at every row count: the measurement behind the MKL rule in
rollout/engine/cpu/features.py (rollout/engine/cpu/mkl_packed.py).

1. One pass over W1's linears as the engine runs them (per layer q/k/v stacked, o, gate and up, down; then the
   lm_head; distinct weights per layer, ~103 MB, more than a last-level cache, as in a step), at 1-256 rows, paths
   alternated, best of `--rounds`:
   - `F.linear` (MKL's sgemm/sgemv on the weights as stored),
   - oneDNN's packed copies (gate and up as the fused pair of matmuls with SiLU and product post-ops),
   - MKL's packed copies (gate and up stacked as one matmul, then SiLU and product),
   - the oneDNN rules (F.linear up to 2 rows and the small-rows kernel at 3-8 where built, oneDNN's copies above).
2. The engine: two engines over one model in one process, one with MKL's copies and one with oneDNN's rules, each
   decoding `streams` greedy requests; timed blocks of steps alternate between them, and the ratio of step times is
   reported per block pair (geometric mean, 95% interval), so the machine's drift cancels.

    python benchmarks/linear_backends.py
    python benchmarks/linear_backends.py --streams 1,8,64 --rounds 8 --compile-level 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import MODEL_CONFIG, build_model, format_table, log, paired_ratio, seconds_per_call

PASS_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _layer_weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    c = MODEL_CONFIG
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q_k_v = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d

    def w(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
    return {"qkv": w(q_k_v, h), "o": w(h, c["num_attention_heads"] * d), "gate": w(inter, h), "up": w(inter, h),
            "down": w(h, inter)}


def _paths(layers: list[dict], lm_head: torch.Tensor) -> dict[str, object]:
    """name -> (rows -> a callable running the pass at that many rows), or None where a path does not exist here."""
    from rollout.engine.cpu import mkl_packed
    from rollout.engine.cpu.features import SMALL_MATMUL_ROWS, cpu_features
    from rollout.engine.cpu.kernel import load_kernel
    from rollout.engine.cpu.matmuls import small_matmul
    from rollout.engine.cpu.mkl_packed import MklPackedWeight
    from rollout.engine.cpu.packed_linear import PACK_BATCH_HINT

    pointwise, binary = torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary
    onednn = [{k: torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for k, w in layer.items()}
              for layer in layers]
    onednn_head = torch.ops.mkldnn._reorder_linear_weight(lm_head, PACK_BATCH_HINT)

    def f_linear(x):
        for layer in layers:
            F.linear(x, layer["qkv"]), F.linear(x, layer["o"])
            F.linear(F.silu(F.linear(x, layer["gate"])) * F.linear(x, layer["up"]), layer["down"])
        return F.linear(x, lm_head)

    def onednn_pass(x):
        for layer in onednn:
            pointwise(x, layer["qkv"], None, "none", [], ""), pointwise(x, layer["o"], None, "none", [], "")
            gated = pointwise(x, layer["gate"], None, "swish", [], "")
            pointwise(binary(x, gated, layer["up"], None, "mul"), layer["down"], None, "none", [], "")
        return pointwise(x, onednn_head, None, "none", [], "")

    paths = {"F.linear": f_linear, "oneDNN packed": onednn_pass, "MKL packed": None, "oneDNN rules": None}
    if mkl_packed.available():
        mkl = [{"qkv": MklPackedWeight(layer["qkv"]), "o": MklPackedWeight(layer["o"]),
                "gate_up": MklPackedWeight(torch.cat([layer["gate"], layer["up"]])),
                "down": MklPackedWeight(layer["down"])} for layer in layers]
        mkl_head = MklPackedWeight(lm_head)

        def mkl_pass(x):
            for layer in mkl:
                layer["qkv"].linear(x), layer["o"].linear(x)
                gate, up = layer["gate_up"].linear(x).chunk(2, dim=-1)
                layer["down"].linear(F.silu(gate).mul_(up))
            return mkl_head.linear(x)
        paths["MKL packed"] = mkl_pass
    kernel = load_kernel() is not None and cpu_features().small_matmul_kernel

    def kernel_pass(x):
        for layer in layers:
            small_matmul(x, layer["qkv"], None), small_matmul(x, layer["o"], None)
            gated = F.silu(small_matmul(x, layer["gate"], None)) * small_matmul(x, layer["up"], None)
            small_matmul(gated, layer["down"], None)
        return small_matmul(x, lm_head, None)

    def rules(x):
        if x.shape[0] <= 2:
            return f_linear(x)
        if kernel and x.shape[0] <= SMALL_MATMUL_ROWS[1]:
            return kernel_pass(x)
        return onednn_pass(x)
    paths["oneDNN rules"] = rules
    return paths


def linear_pass_rows(rounds: int) -> list[list]:
    g = torch.Generator().manual_seed(0)
    layers = [_layer_weights(g) for _ in range(MODEL_CONFIG["num_hidden_layers"])]
    lm_head = torch.randn(MODEL_CONFIG["vocab_size"], MODEL_CONFIG["hidden_size"], generator=g) * 0.04
    megabytes = (sum(w.numel() for layer in layers for w in layer.values()) + lm_head.numel()) * 4 / 1e6
    paths = _paths(layers, lm_head)
    out = []
    with torch.inference_mode():
        for rows in PASS_ROWS:
            x = torch.randn(rows, MODEL_CONFIG["hidden_size"], generator=g)
            best = {name: float("inf") for name, fn in paths.items() if fn is not None}
            for _ in range(rounds):  # the paths alternate, round by round
                for name in best:
                    best[name] = min(best[name], seconds_per_call(lambda fn=paths[name], x=x: fn(x), 0.3))
            ratio = best["MKL packed"] / best["oneDNN rules"] if "MKL packed" in best else float("nan")
            out.append([f"{rows}", *(f"{best[n] * 1e3:.2f}" if n in best else "-" for n in paths), f"{ratio:.3f}"])
    log(f"linear pass: {megabytes:.0f} MB of weights")
    return out


def _engines(model, level: int, streams: int):
    from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams

    engines = {}
    for name, mkl in (("MKL", True), ("oneDNN", False)):
        engine = LLMEngine(model, None, ContinuousBatchingConfig(default_compile_level=level))
        engine.runner.linears.use_mkl(mkl)
        rng = random.Random(streams)
        params = SamplingParams(max_new_tokens=100_000, temperature=0.0, ignore_eos=True)
        for _ in range(streams):
            prompt = [rng.randrange(1, MODEL_CONFIG["vocab_size"]) for _ in range(rng.randint(16, 128))]
            engine.add_request(prompt, sampling_params=params)
        for _ in range(3):  # prefill, then the first decode steps (and their compilation)
            engine.step()
        engines[name] = engine
    return engines


def engine_rows(args) -> list[list]:
    model = build_model("float32")
    out = []
    for streams in args.streams:
        engines = _engines(model, args.compile_level, streams)
        times: dict[str, list[float]] = {name: [] for name in engines}
        with torch.inference_mode():
            for rnd in range(args.rounds):
                for name in (("MKL", "oneDNN") if rnd % 2 == 0 else ("oneDNN", "MKL")):
                    engine = engines[name]
                    engine.step()
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        engine.step()
                    times[name].append((time.perf_counter() - start) / args.steps)
        mean, low, high = paired_ratio(times["MKL"], times["oneDNN"])
        median = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
        out.append([f"{streams}", f"{median['oneDNN']:.2f}", f"{median['MKL']:.2f}",
                    f"{mean:.3f} [{low:.3f}-{high:.3f}]"])
        for engine in engines.values():
            engine.runner.linears.clear()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="decode steps per timed block in the engine rows")
    parser.add_argument("--compile-level", type=int, default=1)
    parser.add_argument("--streams", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 8, 16, 64])
    parser.add_argument("--skip-pass", action="store_true", help="only the engine rows")
    parser.add_argument("--skip-engine", action="store_true", help="only the linear pass")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from rollout.engine.cpu import mkl_packed
    from rollout.engine.cpu.features import cpu_features

    log(f"CPU: {cpu_features().describe()}")
    if not mkl_packed.available():
        raise SystemExit(f"MKL's packed sgemm is unavailable here ({mkl_packed.unavailable_reason()}): nothing to "
                         "compare")
    if not args.skip_pass:
        print(format_table(["rows", "F.linear ms", "oneDNN packed ms", "MKL packed ms", "oneDNN rules ms",
                            "MKL / oneDNN rules"], linear_pass_rows(args.rounds)))
    if not args.skip_engine:
        print(format_table(["streams", "oneDNN rules ms/step", "MKL ms/step", "MKL / oneDNN (paired, 95% CI)"],
                           engine_rows(args)))


if __name__ == "__main__":
    main()
