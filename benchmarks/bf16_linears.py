"""bf16 linears at a model's shape, per row count: the ways the engine can run them on a CPU (the measurement behind the
bf16 route in rollout/engine/cpu/features.py).

One pass over the model's linears as the engine runs them (per layer: q/k/v, o, gate and up, down; then the lm_head),
distinct weights per layer as in a step, random bf16 values, at 1-512 rows; paths alternated, best of `--rounds`:
- `F.linear` on the bf16 weights (oneDNN's bf16 arithmetic, emulated on CPUs without bf16 dot products);
- fp32 copies (oneDNN's packed fp32 weights: the input widened, each output rounded to bf16), linears apart;
- panels (csrc/panel_matmul.c over panels of the bf16 weights): q/k/v and gate/up stacked, as the engine stacks them;
- the small-rows kernel on the bf16 weights as stored (csrc/small_matmul.c), up to 16 rows.
Also the RAM each path's copies take beside the weights, and the rate of the panels in GFLOP/s (2 x rows x weights).

    python benchmarks/bf16_linears.py --model qwen3-0.6b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import format_table, log, seconds_per_call
from benchmarks.shapes import MODEL_CHOICES, model_shape

PASS_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SMALL_KERNEL_MAX_ROWS = 16


def _layers(shape: dict, g: torch.Generator) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    h, d = shape["hidden_size"], shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    heads, kv, inter = shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"]

    def w(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).bfloat16()
    layers = [{"q": w(heads * d, h), "k": w(kv * d, h), "v": w(kv * d, h), "o": w(h, heads * d), "gate": w(inter, h),
               "up": w(inter, h), "down": w(h, inter)} for _ in range(shape["num_hidden_layers"])]
    return layers, w(shape["vocab_size"], h)


def _passes(layers: list[dict], head: torch.Tensor) -> tuple[dict[str, object], dict[str, int]]:
    """name -> a callable running the pass on x; name -> bytes its copies take beside the weights."""
    from rollout.engine.cpu.kernel import load_kernel
    from rollout.engine.cpu.matmuls import small_matmul
    from rollout.engine.cpu.packed_linear import PACK_BATCH_HINT
    from rollout.engine.cpu.panel_packed import PanelWeight

    pointwise = torch.ops.mkldnn._linear_pointwise.default
    o_width = layers[0]["o"].shape[1]

    def run(x, linear, per_layer, lm_head):
        for layer in per_layer:
            qkv = linear(x, layer["qkv"]) if "qkv" in layer else torch.cat([linear(x, layer[n]) for n in "qkv"], -1)
            if "gate_up" in layer:
                gate, up = linear(x, layer["gate_up"]).chunk(2, dim=-1)
            else:
                gate, up = linear(x, layer["gate"]), linear(x, layer["up"])
            linear(qkv[:, :o_width].contiguous(), layer["o"])  # as wide as the attention's output
            linear(F.silu(gate) * up, layer["down"])
        return linear(x, lm_head)

    fp32 = [{k: torch.ops.mkldnn._reorder_linear_weight(w.float(), PACK_BATCH_HINT) for k, w in layer.items()}
            for layer in layers]
    fp32_head = torch.ops.mkldnn._reorder_linear_weight(head.float(), PACK_BATCH_HINT)
    passes = {"F.linear": lambda x: run(x, lambda x, w: F.linear(x, w), layers, head),
              "fp32 copies": lambda x: run(x, lambda x, p: pointwise(x.float(), p, None, "none", [], "").bfloat16(),
                                           fp32, fp32_head)}
    sizes = {"F.linear": 0, "fp32 copies": sum(w.numel() * 4 for layer in layers for w in layer.values())
             + head.numel() * 4}
    if load_kernel() is not None:
        panels = [{"qkv": PanelWeight(torch.cat([layer[n] for n in "qkv"])), "o": PanelWeight(layer["o"]),
                   "gate_up": PanelWeight(torch.cat([layer["gate"], layer["up"]])), "down": PanelWeight(layer["down"])}
                  for layer in layers]
        panel_head = PanelWeight(head)
        passes["panels"] = lambda x: run(x, lambda x, p: p.linear(x), panels, panel_head)
        sizes["panels"] = sum(p.panels.numel() * 2 for layer in panels for p in layer.values()) + head.numel() * 2
        passes["small-rows kernel"] = lambda x: run(x, lambda x, w: small_matmul(x, w, None), layers, head)
        sizes["small-rows kernel"] = 0
    return passes, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=MODEL_CHOICES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from rollout.engine.cpu.features import cpu_features

    log(f"CPU: {cpu_features().describe()}")
    log(f"bf16 route: {cpu_features().bf16_route.describe()}")
    shape = model_shape(args.model)
    g = torch.Generator().manual_seed(0)
    layers, head = _layers(shape, g)
    params = sum(w.numel() for layer in layers for w in layer.values()) + head.numel()
    passes, sizes = _passes(layers, head)
    log(f"{args.model}: {params / 1e6:.0f}M linear weights, {params * 2 / 1e6:.0f} MB in bf16; copies beside them: "
        + ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in sizes.items()))
    rows_out = []
    with torch.inference_mode():
        for rows in PASS_ROWS:
            x = torch.randn(rows, shape["hidden_size"], generator=g).bfloat16()
            names = [n for n in passes if n != "small-rows kernel" or rows <= SMALL_KERNEL_MAX_ROWS]
            if rows > 64:
                names.remove("F.linear")  # emulated bf16 at prefill sizes: minutes, and never the choice
            best = dict.fromkeys(names, float("inf"))
            for _ in range(args.rounds):  # the paths alternate, round by round
                for name in names:
                    best[name] = min(best[name], seconds_per_call(lambda fn=passes[name], x=x: fn(x), 0.3))
            others = min(s for n, s in best.items() if n != "panels") if "panels" in best else float("nan")
            gflops = 2 * rows * params / best["panels"] / 1e9 if "panels" in best else float("nan")
            rows_out.append([f"{rows}", *(f"{best[n] * 1e3:.1f}" if n in best else "-" for n in passes),
                             f"{others / best.get('panels', float('nan')):.2f}", f"{gflops:.0f}"])
    print(format_table(["rows", *(f"{n} ms" for n in passes), "best other / panels", "panels GFLOP/s"], rows_out))


if __name__ == "__main__":
    main()
