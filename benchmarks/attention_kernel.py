"""The C paged-attention kernel against an earlier version of itself, on step-shaped batches, in one process.

Both libraries are built from source (this checkout's `rollout/engine/cpu/csrc/paged_attention.c`, and the same file at
a git revision or a path) and called alternately on the same tensors; the table gives the best of `--rounds` per
batch. W1's attention shapes: 8 query heads, 4 kv heads, head_dim 64, pages of 32. "forks" are decode tokens of
samples forked from one prompt: they share the prompt's full pages and have pages of their own.

    python benchmarks/attention_kernel.py --baseline HEAD~1
    python benchmarks/attention_kernel.py --baseline old_kernel.c --dtype bfloat16 --end-to-end
    python benchmarks/attention_kernel.py --baseline HEAD~1 --shape qwen3-0.6b --layers 28 --only GRPO  # past the L3

`--end-to-end` also times `generate_batch` with each kernel: 8 prompts of 512 random ids, 8 samples each, 64 new
tokens (the case that gains most: long shared prompts).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import REPO_ROOT, build_model, environment, format_table, log, seconds_per_call
from rollout.engine.cpu import kernel as cpu_kernel
from rollout.engine.cpu.kernel import KernelBatch, paged_attention

PAGE = 32
SHAPES = {"w1": (8, 4, 64), "qwen3-0.6b": (16, 8, 128)}  # query heads, kv heads, head_dim
HEADS, KV_HEADS, HEAD_DIM = SHAPES["w1"]


def load(source: Path):
    """Build and load the kernel from `source` (cached by content like the engine's own build)."""
    cpu_kernel.SOURCE = source
    cpu_kernel.load_kernel.cache_clear()
    lib = cpu_kernel.load_kernel()
    if lib is None:
        raise SystemExit(f"the kernel from {source} did not build or load: {cpu_kernel.kernel_build().reason}")
    return lib


def baseline_source(spec: str, folder: Path) -> Path:
    """A path to the kernel source: `spec` itself if it is a file, else the file at git revision `spec`."""
    if Path(spec).is_file():
        return Path(spec)
    text = subprocess.run(["git", "show", f"{spec}:rollout/engine/cpu/csrc/paged_attention.c"], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=True).stdout
    path = folder / "baseline_paged_attention.c"
    path.write_text(text)
    return path


def forks(groups: int, fork: int, prompt: int, own: int, gen: torch.Generator) -> tuple[KernelBatch, int]:
    """Decode tokens of `groups` prompts x `fork` samples; each sample has 0..own tokens of its own."""
    tables, positions, rows, blocks = [], [], [], 0
    for _ in range(groups):
        shared = list(range(blocks, blocks + prompt // PAGE))
        blocks += len(shared)
        for _ in range(fork):
            context = prompt + int(torch.randint(0, own + 1, (1,), generator=gen))
            extra = list(range(blocks, blocks + context // PAGE + 1 - len(shared)))
            blocks += len(extra)
            tables.append(shared + extra)
            rows.append(len(tables) - 1)
            positions.append(context - 1)
    return _batch(tables, positions, rows, gen), blocks


def prefill(prompts: int, length: int, gen: torch.Generator) -> tuple[KernelBatch, int]:
    """Whole prompts of `length` tokens, one row each."""
    per_row = length // PAGE + 1
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(prompts)]
    positions = [p for _ in range(prompts) for p in range(length)]
    rows = [r for r in range(prompts) for _ in range(length)]
    return _batch(tables, positions, rows, None), prompts * per_row


def _batch(tables, positions, rows, gen) -> KernelBatch:
    width = max(len(t) for t in tables)
    order = torch.randperm(len(rows), generator=gen) if gen is not None else torch.arange(len(rows))
    return KernelBatch(torch.tensor(positions)[order], torch.tensor(rows)[order],
                       torch.tensor([t + [0] * (width - len(t)) for t in tables]))


def cases(gen: torch.Generator) -> dict[str, tuple[KernelBatch, int]]:
    return {
        "decode, 32 prompts x 8 forks, prompt 200 (192 shared), own 0": forks(32, 8, 200, 0, gen),
        "decode, 32 x 8 forks, prompt 170 (160 shared), own 0-100": forks(32, 8, 170, 100, gen),
        "decode, 32 x 8 forks, prompt 70 (64 shared), own 0-100": forks(32, 8, 70, 100, gen),
        "decode, 32 x 8 forks, prompt 20 (none shared), own 100-200": forks(32, 8, 20, 150, gen),
        "decode, 64 distinct rows, context 100-300": forks(64, 1, 100, 200, gen),
        "decode, 1 row, context 200": forks(1, 1, 200, 0, gen),
        "prefill, 32 prompts x 64": prefill(32, 64, gen),
        "prefill, 4 prompts x 512": prefill(4, 512, gen),
        "decode, GRPO: 4 prompts x 4 forks, prompt 200 (192 shared), own 0-200": forks(4, 4, 200, 200, gen),
        "decode, GRPO: 2 prompts x 8 forks, prompt 200 (192 shared), own 0-200": forks(2, 8, 200, 200, gen),
        "decode, GRPO: 4 prompts x 6 forks, prompt 200 (192 shared), own 0-200": forks(4, 6, 200, 200, gen),
        "decode, GRPO: 4 prompts x 7 forks, prompt 200 (192 shared), own 0-200": forks(4, 7, 200, 200, gen),
        "decode, GRPO tail: 4 prompts x 2 forks, prompt 200 (192 shared), own 0-200": forks(4, 2, 200, 200, gen),
        "decode, GRPO tail: 4 prompts x 3 forks, prompt 200 (192 shared), own 0-200": forks(4, 3, 200, 200, gen),
        "decode, GRPO tail: 8 prompts x 2 forks, prompt 70 (64 shared), own 0-200": forks(8, 2, 70, 200, gen),
    }


def kernel_rows(libs: dict, dtype: torch.dtype, rounds: int, layers: int, only: str = "") -> list[list]:
    """Per batch, ms per layer of each kernel. With `layers` > 1 each call attends over that many caches in turn, as
    a model's layers do, so what a layer reads has left the caches by the time it is read again."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (batch, blocks) in cases(gen).items():
        if only not in name:
            continue
        caches = [(torch.randn(blocks * PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
                   torch.randn(blocks * PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)) for _ in range(layers)]
        q = torch.randn(len(batch.positions), HEADS, HEAD_DIM, generator=gen).to(dtype)
        outputs, best = {}, {}

        def attend(q=q, caches=caches, batch=batch):
            for k, v in caches:
                out = paged_attention(q, k, v, batch, PAGE, HEAD_DIM ** -0.5, None, None)
            return out

        for _ in range(rounds):
            for tag, lib in libs.items():
                cpu_kernel.load_kernel = lambda lib=lib: lib
                outputs[tag] = attend()
                best[tag] = min(best.get(tag, float("inf")), seconds_per_call(attend, 0.3) / layers)
        diff = (outputs["baseline"].float() - outputs["current"].float()).abs().max().item()
        rows.append([name, f"{best['baseline'] * 1e3:.3f}", f"{best['current'] * 1e3:.3f}",
                     f"{best['baseline'] / best['current']:.2f}x", f"{diff:.1e}"])
    return rows


def end_to_end_row(libs: dict, rounds: int) -> list:
    from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch

    model = build_model("float32")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (512,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(n=8, seed=1, max_new_tokens=64, temperature=1.0, ignore_eos=True)
    generate_batch(model, prompts[:2], None, ContinuousBatchingConfig(), sampling_params=params, progress_bar=False)
    best = {}
    for _ in range(rounds):
        for tag, lib in libs.items():
            cpu_kernel.load_kernel = lambda lib=lib: lib
            start = time.perf_counter()
            generate_batch(model, prompts, None, ContinuousBatchingConfig(), sampling_params=params,
                           progress_bar=False)
            best[tag] = min(best.get(tag, float("inf")), time.perf_counter() - start)
    return ["generate_batch: 8 prompts x 512, n=8, 64 new tokens (s)", f"{best['baseline']:.2f}",
            f"{best['current']:.2f}", f"{best['baseline'] / best['current']:.2f}x", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision, or path to a paged_attention.c")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5, help="alternated timing rounds per batch (best is kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--end-to-end", action="store_true", help="also time generate_batch on long shared prompts")
    parser.add_argument("--shape", default="w1", choices=list(SHAPES),
                        help="attention heads, kv heads and head size: W1's, or Qwen3-0.6B's (16, 8, 128)")
    parser.add_argument("--layers", type=int, default=1,
                        help="caches attended in turn per call, like a model's layers (28: past a large L3)")
    parser.add_argument("--only", default="", help="only the batches whose name contains this, e.g. GRPO")
    args = parser.parse_args()
    global HEADS, KV_HEADS, HEAD_DIM
    HEADS, KV_HEADS, HEAD_DIM = SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    current = cpu_kernel.SOURCE
    with tempfile.TemporaryDirectory() as folder:
        libs = {"baseline": load(baseline_source(args.baseline, Path(folder))), "current": load(current)}
    log(f"{environment()}")
    rows = kernel_rows(libs, getattr(torch, args.dtype), args.rounds, args.layers, args.only)
    if args.end_to_end:
        rows.append(end_to_end_row(libs, max(2, args.rounds // 2)))
    print(format_table([f"batch ({args.shape}, {args.dtype}, {args.threads} threads, {args.layers} layers)",
                        "baseline ms", "current ms", "speedup", "max |diff|"], rows))


if __name__ == "__main__":
    main()
