"""Tensor parallelism on this machine's CPU: one process with every core against N gloo ranks with a core each.

The same greedy workload (P prompts x new tokens, random weights of a real shape) runs through `generate_batch`
once in a single process and once with the model sharded by transformers over N ranks (each rank a plain process, as
`torchrun` would start it). The table gives tokens/s, the weights and the KV bytes per token each process holds, and
whether every rank's tokens equal the single process's.

    python benchmarks/tensor_parallel.py                          # qwen3-0.6b shape, fp32, 2 ranks
    python benchmarks/tensor_parallel.py --model llama-3.2-1b --dtype bfloat16 --prompts 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig, GenerationConfig

from benchmarks.common import environment, format_table, log
from benchmarks.shapes import REAL_SHAPES, build_real
from rollout import ContinuousBatchingConfig, LLMEngine, generate_batch
from rollout.engine.tensor_parallel import local_tensor

PAGE = 32


def workload(args) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]


def measure(model, args) -> dict:
    """Generate the workload twice (the first warms up); the second's rate, and what this process holds."""
    config = ContinuousBatchingConfig(page_size=PAGE)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False)
    prompts = workload(args)
    generate_batch(model, prompts[:1], GenerationConfig(max_new_tokens=4, do_sample=False), config,
                   progress_bar=False)
    start = time.perf_counter()
    outs = generate_batch(model, prompts, gen, config, progress_bar=False)
    seconds = time.perf_counter() - start
    tokens = [o.generated_tokens for o in outs.values()]
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=PAGE, num_blocks=1))
    weights = sum(local_tensor(p).nbytes for p in model.parameters())
    return dict(seconds=seconds, tok_s=sum(map(len, tokens)) / seconds, tokens=tokens,
                kv_bytes_per_token=engine.cache.shape.bytes_per_token(engine.cache.dtype), weight_bytes=weights)


def rank_main(args) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype),
                                                 distributed_config=DistributedConfig(tp_size=args.ranks)).eval()
    result = measure(model, args)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    os._exit(0)


def run_ranks(args, checkpoint: Path, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    base = [sys.executable, __file__, "--rank-child", "--checkpoint", str(checkpoint), "--out", str(out),
            "--threads", str(threads), *sys.argv[1:]]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(args.ranks),
           "OMP_NUM_THREADS": str(threads)}
    procs = [subprocess.Popen(base, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(args.ranks)]
    if any(p.wait() for p in procs):
        raise SystemExit("a rank failed (see its output above)")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(REAL_SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        return rank_main(args)
    log(json.dumps(environment()))
    with tempfile.TemporaryDirectory() as tmp:
        model = build_real(args.model, args.dtype)
        model.save_pretrained(Path(tmp, "model"))
        torch.set_num_threads(os.cpu_count() or 1)
        single = measure(model, args)
        del model
        ranks = run_ranks(args, Path(tmp, "model"), Path(tmp))
    rows = [["1 process", f"{torch.get_num_threads()} threads", f"{single['tok_s']:.1f}", "1.00x",
             f"{single['weight_bytes'] / 2**20:.0f}", single["kv_bytes_per_token"], "-"]]
    for r, rank in enumerate(ranks):
        rows.append([f"rank {r} of {args.ranks}", f"{max(1, (os.cpu_count() or 1) // args.ranks)} threads",
                     f"{rank['tok_s']:.1f}", f"{rank['tok_s'] / single['tok_s']:.2f}x",
                     f"{rank['weight_bytes'] / 2**20:.0f}", rank["kv_bytes_per_token"],
                     "yes" if rank["tokens"] == single["tokens"] else "no"])
    print(f"\n{args.model} {args.dtype}, {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} greedy "
          f"tokens each; cpu flags: {environment()['cpu_flags']}")
    print(format_table(["process", "threads", "tok/s", "vs 1 process", "weights MiB", "KV bytes/token",
                        "same tokens"], rows))


if __name__ == "__main__":
    main()
