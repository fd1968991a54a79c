"""Logprob fidelity: the engine's `policy_logprobs` against a trainer's forward of the same weights.

An RL loss takes the ratio of the trainer's logprobs to the ones the rollout engine reported; any difference between
them is off-policy noise the trainer never asked for. This samples `--prompts` x `--samples` completions through a
RolloutGenerator and recomputes each sampled token's logprob with one plain transformers forward over prompt +
completion (what a trainer runs: the model in its own dtype, fp32 log_softmax of the logits). It reports the max,
p99 and median |engine - trainer| over all sampled tokens, and, for a bf16 run, how far each side is from an fp32
forward of the same (bf16-rounded) weights, so a gap can be told apart from bf16's own rounding.

    python benchmarks/logprob_fidelity.py                                   # W1's model, bf16
    python benchmarks/logprob_fidelity.py --model qwen3-0.6b --dtype bfloat16 --prompts 8 --new-tokens 64
    python benchmarks/logprob_fidelity.py --model smollm2-135m --dtype float32
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from benchmarks.common import cpu_flags, format_table
from benchmarks.shapes import MODEL_CHOICES, build_named
from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """Each completion token's logprob under one forward over prompt + completion (temperature 1)."""
    logits = model(torch.tensor([prompt + completion])).logits[0].float()
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)].log_softmax(-1)
    return rows.gather(1, torch.tensor(completion)[:, None]).squeeze(1).numpy()


@torch.no_grad()
def incremental_logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """The same logprobs from transformers' own KV-cached decoding: the prompt in one forward, then one token per
    forward, as `model.generate` computes them. Its distance from the full forward is the floor any KV-cached decoder
    starts from in this dtype (one row per matmul, not the trainer's whole sequence)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    rows = [out.logits[0, -1].float().log_softmax(-1)[completion[0]].item()]
    cache = out.past_key_values
    for prev, token in itertools.pairwise(completion):
        out = model(torch.tensor([[prev]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0, -1].float().log_softmax(-1)[token].item())
    return np.asarray(rows)


def summary(deltas: np.ndarray) -> list[str]:
    return [f"{deltas.max():.2e}", f"{np.quantile(deltas, 0.99):.2e}", f"{np.median(deltas):.2e}",
            f"{deltas.mean():.2e}"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="w1", choices=MODEL_CHOICES)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=64, help="sampled tokens per completion (EOS ignored)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--floor-samples", type=int, default=4,
                   help="completions also decoded by transformers' KV-cached decoding, for the floor (0: skip)")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                   help="a ContinuousBatchingConfig field for the engine, e.g. prepack_weights=False (repeatable)")
    args = p.parse_args(argv)
    fields = {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in args.config)}
    torch.set_num_threads(args.threads)

    model = build_named(args.model, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens, ignore_eos=True,
                            seed=args.seed)
    with RolloutGenerator(model, continuous_batching_config=ContinuousBatchingConfig(**fields)) as gen:
        batch = gen.generate(prompts, n=args.samples, sampling_params=params)
    engine = np.concatenate([np.asarray(s.policy_logprobs, dtype=np.float64) for s in batch.samples])
    trainer = np.concatenate([forward_logprobs(model, s.prompt_ids, s.completion_ids) for s in batch.samples])
    rows = [["engine vs trainer forward", *summary(np.abs(engine - trainer))]]
    floor = batch.samples[:args.floor_samples]
    if floor:
        cached = np.concatenate([incremental_logprobs(model, s.prompt_ids, s.completion_ids) for s in floor])
        rows.append([f"transformers KV-cached decode vs trainer forward ({len(floor)} completions)",
                     *summary(np.abs(cached - trainer[:cached.size]))])
    if args.dtype != "float32":  # the same rounded weights in fp32: each side's distance from exact arithmetic
        model.float()
        exact = np.concatenate([forward_logprobs(model, s.prompt_ids, s.completion_ids) for s in batch.samples])
        rows += [["engine vs fp32 forward", *summary(np.abs(engine - exact))],
                 ["trainer vs fp32 forward", *summary(np.abs(trainer - exact))]]
    print(f"logprob fidelity  model={args.model}  dtype={args.dtype}  {len(batch.samples)} completions x "
          f"{args.new_tokens} sampled tokens ({engine.size} tokens), prompts of {args.prompt_len}, "
          f"torch {torch.__version__}, {args.threads} threads, engine config {fields or 'defaults'}")
    print(f"CPU flags: {cpu_flags()}")
    print(format_table(["|delta logprob|", "max", "p99", "median", "mean"], rows))


if __name__ == "__main__":
    main()
