"""A hand-written PPO-style loop under `accelerate launch`, generating with the rollout engine.

Each process runs its own engine on its shard of the prompts, trains its (DDP-wrapped) policy, and after every
optimizer step `WeightSync` copies the new weights into its engine in place (the KV cache stays allocated). The
baseline is value-free: GRPO-style group-normalised rewards; the loss is PPO's clipped ratio against the engine's
`policy_logprobs` (the full-vocabulary log_softmax(logits / T) that this loop recomputes, so the first ratio is 1).

    accelerate launch --multi_gpu --num_processes 2 examples/ppo_accelerate.py   # 2 CPU processes (gloo)
    python examples/ppo_accelerate.py --steps 20                                 # one process
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from rollout.demo import task
from rollout.demo.run import DEFAULT_MODEL
from rollout.rl.losses import completion_logprobs, group_advantages
from trainer_hooks import WeightSync


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts-per-step", type=int, default=16, help="global, split across processes")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--ppo-epochs", type=int, default=2)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write a JSON report per process to OUT.rank<i>.json")
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(args.seed)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    generator = RolloutGenerator(model, tokenizer=tokenizer, seed=args.seed + accelerator.process_index,
                                 continuous_batching_config=ContinuousBatchingConfig(page_size=16))
    cache_ptrs = generator.manager.engine.cache.data_ptrs()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    sync = WeightSync(generator, model, every=1)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)

    history = []
    bar = tqdm(range(args.steps), disable=not accelerator.is_main_process, desc="ppo")
    for step in bar:
        rows = task.make_prompts(args.prompts_per_step, seed=args.seed * 100_003 + step)
        shard = rows[accelerator.process_index::accelerator.num_processes]
        batch = generator.generate([r["prompt"] for r in shard], n=args.group,
                                   sampling_params=sampling.with_overrides(seed=step))
        rewards = torch.tensor(task.reward([s.text for s in batch.samples],
                                           [r["answer"] for r in shard for _ in range(args.group)]))
        advantages = group_advantages(rewards, batch.group_sizes)
        tensors = batch.to_tensors(pad_token_id=tokenizer.pad_token_id, device=accelerator.device)
        mask = tensors["completion_mask"].float()
        old = tensors["policy_logprobs"]
        model.train()
        for _ in range(args.ppo_epochs):
            new = completion_logprobs(model, tensors, args.temperature)
            ratio = torch.exp(new - old)
            adv = advantages.to(accelerator.device)[:, None]
            loss = -torch.min(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv)
            loss = (loss * mask).sum() / mask.sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        sync()  # after optimizer.step(): the engine takes the new weights in place
        metrics = sync.log(batch, step=step)
        mean_reward = accelerator.gather(rewards.mean()[None].to(accelerator.device)).mean().item()
        history.append({"step": step, "reward": mean_reward, "loss": loss.item(),
                        "weight_version": generator.weight_version,
                        "tokens_per_second": metrics["rollout/tokens_per_second"]})
        bar.set_postfix(reward=f"{mean_reward:.2f}")

    result = {"rank": accelerator.process_index, "world": accelerator.num_processes, "history": history,
              "weight_version": generator.weight_version, "shard_size": len(shard),
              "kv_cache_kept": generator.manager.engine.cache.data_ptrs() == cache_ptrs}
    # The engine generates exactly what the trained module would: greedy check on a few prompts.
    policy = accelerator.unwrap_model(model)
    probe = [r["prompt"] for r in task.make_prompts(4, seed=999)]
    greedy = generator.generate(probe, sampling_params=SamplingParams(temperature=0, max_new_tokens=4))
    with torch.no_grad():
        refs = [policy.generate(torch.tensor([s.prompt_ids]), max_new_tokens=4, do_sample=False)[
            0, len(s.prompt_ids):].tolist() for s in greedy.samples]
    result["engine_matches_trained_model"] = [s.completion_ids for s in greedy.samples] == refs
    result["weights_checksum"] = float(sum(p.double().sum() for p in policy.parameters()))
    result["shard_prompts"] = [r["prompt"] for r in shard]
    if args.out:
        Path(f"{args.out}.rank{accelerator.process_index}.json").write_text(json.dumps(result))
    generator.close()
    return result


if __name__ == "__main__":
    main()
