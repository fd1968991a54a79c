"""Sanity check: a minimal GRPO loop in plain PyTorch raises the tiny policy's sampled accuracy quickly.

Each step samples ``--G`` completions for each of ``--prompts`` prompts with ``model.generate`` (temperature 1.0, no
top-k/top-p), rewards them with :func:`rollout.demo.task.reward`, normalises the rewards within each group
(``(r - mean) / (std + eps)``, as TRL's ``scale_rewards="group"``), and takes one AdamW step on the policy-gradient
loss ``-sum(A * logp(token)) / n_tokens`` over the completion tokens (EOS included; token-level normalisation as in
TRL's ``dapo``/``bnpo`` losses; one update per batch, so the PPO ratio is 1 and clipping never fires).  ``--beta``
adds TRL's k3 KL estimate to a frozen reference copy.

Every ``--eval-every`` steps it prints the greedy and sampled (T=1) accuracy on the 500 held-out prompts::

    python examples/check_tiny_policy_rl.py                       # rollout/assets/tiny-policy, 30 steps
    python examples/check_tiny_policy_rl.py --lr 5e-4 --steps 40
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.demo import task

REPO = Path(__file__).resolve().parents[1]


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], max_new_tokens: int, do_sample: bool = True):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kw,
    )
    prompt_len = enc["input_ids"].shape[1]
    completion_ids = out[:, prompt_len:]
    # keep tokens up to and including the first EOS
    is_eos = completion_ids == tokenizer.eos_token_id
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    completion_mask = (~after_eos).long()
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return enc, completion_ids, completion_mask, texts


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    logits = logits[:, prompt_ids.shape[1] - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, tokenizer, rows, seed: int) -> tuple[float, float]:
    model.eval()
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    greedy = task.accuracy(sample(model, tokenizer, prompts, 5, do_sample=False)[3], answers)
    rng_state = torch.get_rng_state()  # evaluation must not perturb the training run's sampling stream
    torch.manual_seed(seed)
    sampled = task.accuracy(sample(model, tokenizer, prompts, 5)[3], answers)
    torch.set_rng_state(rng_state)
    return greedy, sampled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "rollout" / "assets" / "tiny-policy"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--G", type=int, default=8, help="completions per prompt (TRL num_generations)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient to the initial policy (TRL beta)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ref = copy.deepcopy(model).eval() if args.beta > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    eval_rows = task.eval_prompts()
    train_rows = task.make_prompts(args.steps * args.prompts, seed=args.seed + 1)
    rng = random.Random(args.seed)
    rng.shuffle(train_rows)
    print(
        f"lr {args.lr}  G {args.G}  prompts/step {args.prompts}  (batch {args.G * args.prompts} completions)  "
        f"beta {args.beta}  temperature 1.0"
    )

    t0 = time.time()
    g, s = evaluate(model, tokenizer, eval_rows, seed=10_000)
    print(f"step   0  eval greedy {g:.3f}  sampled {s:.3f}  {time.time() - t0:6.1f}s", flush=True)
    curve = [(0, s, time.time() - t0)]
    for step in range(1, args.steps + 1):
        rows = train_rows[(step - 1) * args.prompts : step * args.prompts]
        prompts = [r["prompt"] for r in rows for _ in range(args.G)]
        answers = [r["answer"] for r in rows for _ in range(args.G)]
        model.eval()
        enc, comp_ids, comp_mask, texts = sample(model, tokenizer, prompts, args.max_new_tokens)
        rewards = torch.tensor(task.reward(texts, answers)).view(-1, args.G)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1, 1)

        model.train()
        logp = completion_logprobs(model, enc["input_ids"], enc["attention_mask"], comp_ids, comp_mask)
        per_token = -adv * logp
        if ref is not None:
            with torch.no_grad():
                ref_logp = completion_logprobs(ref, enc["input_ids"], enc["attention_mask"], comp_ids, comp_mask)
            per_token = per_token + args.beta * (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1)
        loss = (per_token * comp_mask).sum() / comp_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        line = f"step {step:3d}  batch reward {rewards.mean().item():.3f}"
        if step % args.eval_every == 0 or step == args.steps:
            g, s = evaluate(model, tokenizer, eval_rows, seed=10_000 + step)
            curve.append((step, s, time.time() - t0))
            line += f"  eval greedy {g:.3f}  sampled {s:.3f}"
        print(f"{line}  {time.time() - t0:6.1f}s", flush=True)

    hit = next(((st, sec) for st, acc, sec in curve if acc > 0.7), None)
    start = curve[0][1]
    if hit:
        print(f"sampled accuracy {start:.3f} -> >0.70 at step {hit[0]} ({hit[1]:.1f}s)")
    else:
        print(f"sampled accuracy {start:.3f} -> {curve[-1][1]:.3f}; never above 0.70 in {args.steps} steps")


if __name__ == "__main__":
    main()
