"""Build and pretrain the tiny policy shipped in ``rollout/assets/tiny-policy`` (used by ``rollout demo``).

The policy is a ~0.8M-parameter Qwen3 with an 18-token character-level tokenizer, trained on the two-digit addition
task of :mod:`rollout.demo.task` (``"37+45="`` -> ``"82<eos>"``).  It is deliberately *under-confident*: in the
last part of training the target at the answer's units digit is soft -- the right digit gets ``1 - noise``, each
wrong digit ``noise / 9`` -- so the policy knows the sum (greedy accuracy ~100%) but samples the right units digit
only about 30% of the time at temperature 1.0.  GRPO sharpens the sampling distribution, so the sampled accuracy --
the demo's reward -- rises from ~30% to >70% within a few dozen small steps (see ``check_tiny_policy_rl.py``).

Schedule: clean one-hot targets until ``--ramp-start`` (learn addition), then the units-digit noise ramps linearly
up to ``--noise`` at ``--ramp-end`` and stays there (calibrate the sampling distribution); AdamW with warmup and a
cosine decay to 10% of ``--lr``.  The defaults reproduce the shipped checkpoint (about 6 minutes on one CPU
thread)::

    python examples/train_tiny_policy.py                  # writes rollout/assets/tiny-policy
    python examples/train_tiny_policy.py --out /tmp/p --noise 0.6
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from rollout.demo import task

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "rollout" / "assets" / "tiny-policy"

SPECIAL = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*= ")
MAX_LEN = 64


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then digits, operators, '=', ' '.

    No BOS token and no post-processor, so ``add_special_tokens`` True or False tokenize a prompt the same way.
    """
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=MAX_LEN,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer, seed: int, hidden: int, layers: int, intermediate: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        intermediate_size=intermediate,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    return Qwen3ForCausalLM(config).float()


def make_batch(tokenizer, pairs):
    """Right-padded ``prompt + answer + <eos>`` with labels only on the answer and EOS."""
    seqs, labels = [], []
    for a, b in pairs:
        p = tokenizer.encode(task.format_prompt(a, b))
        ans = tokenizer.encode(str(a + b)) + [tokenizer.eos_token_id]
        seqs.append(p + ans)
        labels.append([-100] * len(p) + ans)
    n = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (n - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (n - len(s)) for s in labels])
    att = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
    return ids, att, lab


def soft_target_loss(logits, labels, noise: float, digit_ids, eos_id: int):
    """Cross-entropy against targets that are one-hot, except at the units digit of the answer (the label just
    before EOS): there the right digit gets ``1 - noise`` and each of the 9 wrong digits ``noise / 9``."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    tgt = labels[:, 1:]
    valid = tgt != -100
    dist = torch.zeros_like(logp)
    dist.scatter_(-1, tgt.clamp(min=0).unsqueeze(-1), 1.0)
    if noise > 0:
        nxt = torch.cat([tgt[:, 1:], torch.full_like(tgt[:, :1], -100)], 1)
        units = valid & (nxt == eos_id)
        u = torch.zeros(int(units.sum()), logp.shape[-1], dtype=logp.dtype)
        u[:, digit_ids] = noise / 9
        u.scatter_(-1, tgt[units].unsqueeze(-1), 1.0 - noise)
        dist[units] = u
    return -(dist * logp).sum(-1)[valid].mean()


@torch.no_grad()
def evaluate(model, tokenizer, rows, sample: bool, seed: int = 0, batch: int = 500) -> float:
    """Accuracy on ``rows`` with ``model.generate``: greedy, or pure sampling at temperature 1.0."""
    model.eval()
    torch.manual_seed(seed)
    completions = []
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        out = model.generate(
            **enc, max_new_tokens=5, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **kw
        )
        completions += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train()
    return task.accuracy(completions, [r["answer"] for r in rows])


@torch.no_grad()
def expected_accuracy(model, tokenizer, rows) -> float:
    """Exact sampled accuracy at temperature 1.0: the mean probability of ``answer + <eos>`` given the prompt."""
    model.eval()
    total = 0.0
    for r in rows:
        p = tokenizer.encode(r["prompt"])
        ids = torch.tensor([p + tokenizer.encode(r["answer"]) + [tokenizer.eos_token_id]])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        total += logp.gather(-1, ids[0, 1:, None])[len(p) - 1 :].sum().exp().item()
    model.train()
    return total / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1200, help="total optimizer steps")
    ap.add_argument("--ramp-start", type=int, default=500, help="clean targets before this step")
    ap.add_argument("--ramp-end", type=int, default=900, help="full --noise from this step on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.7, help="final probability mass on wrong units digits")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=500)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed, args.hidden, args.layers, args.intermediate)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params:,}  vocab: {len(tokenizer)}")

    eval_rows = task.eval_prompts()
    held_out = {r["prompt"] for r in eval_rows}
    train_pairs = [
        (a, b)
        for a in range(task.LOW, task.HIGH + 1)
        for b in range(task.LOW, task.HIGH + 1)
        if task.format_prompt(a, b) not in held_out
    ]
    print(f"train problems: {len(train_pairs)}  held-out: {len(held_out)}")

    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = 100

    def lr_at(step: int) -> float:
        # linear warmup, then cosine down to 10% of --lr
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    t0 = time.time()
    for step in range(args.steps):
        ramp = (step - args.ramp_start) / max(1, args.ramp_end - args.ramp_start)
        noise = args.noise * min(1.0, max(0.0, ramp))
        ids, att, lab = make_batch(tokenizer, rng.choices(train_pairs, k=args.batch))
        logits = model(input_ids=ids, attention_mask=att).logits
        loss = soft_target_loss(logits, lab, noise, digit_ids, tokenizer.eos_token_id)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 100 == 0:
            elapsed = time.time() - t0
            print(f"step {step + 1:5d}  noise {noise:.2f}  loss {loss.item():.4f}  {elapsed:6.1f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            g = evaluate(model, tokenizer, eval_rows, sample=False)
            s = evaluate(model, tokenizer, eval_rows, sample=True)
            print(f"  eval@{step + 1}: greedy {g:.3f}  sampled(T=1) {s:.3f}", flush=True)

    greedy = evaluate(model, tokenizer, eval_rows, sample=False)
    sampled = evaluate(model, tokenizer, eval_rows, sample=True)
    exact = expected_accuracy(model, tokenizer, eval_rows)
    print(
        f"final on {len(eval_rows)} held-out prompts: greedy {greedy:.3f}  sampled(T=1) {sampled:.3f}  "
        f"(exact expected sampled accuracy {exact:.3f})"
    )
    print(f"train time {time.time() - t0:.1f}s")

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=8,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
