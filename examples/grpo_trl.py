"""GRPO with TRL on the rollout engine: the one-line switch from GRPOTrainer to RolloutGRPOTrainer.

A verifiable toy task (two-digit addition) on the embedded tiny policy; runs on 2 CPU cores in a couple of minutes:

    python examples/grpo_trl.py --steps 30

On a GPU, point it at any causal LM with --model (bf16 is picked automatically when supported).
"""

import argparse
import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.demo import task
from rollout.demo.run import DEFAULT_MODEL
from trainer_hooks import RolloutGRPOTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output-dir", default="grpo-trl-example")
    parser.add_argument("--old-logprobs", default="auto", choices=["auto", "engine", "recompute"],
                        help="where TRL's old_per_token_logps come from (auto: the engine's when it is exact)")
    args = parser.parse_args()
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("trainer_hooks").setLevel(logging.INFO)  # says which old-logprob path runs, and why

    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported()  # TRL defaults to bf16=True, which fails on a CPU-only machine
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if bf16 else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    config = GRPOConfig(
        output_dir=args.output_dir, use_cpu=not cuda, bf16=bf16, max_steps=args.steps, learning_rate=5e-4,
        per_device_train_batch_size=64, num_generations=8, max_completion_length=4, temperature=1.0, beta=0.0,
        logging_steps=5, report_to="none", save_strategy="no")
    trainer = RolloutGRPOTrainer(                      # instead of trl.GRPOTrainer
        model=model, reward_funcs=task.reward, args=config, train_dataset=task.make_dataset(4096),
        processing_class=tokenizer,
        rollout_config=ContinuousBatchingConfig(page_size=16),  # the engine's KV cache, kept across steps
        rollout_old_logprobs=args.old_logprobs,  # fp32 on CPU: the engine's logprobs replace TRL's extra forward
    )
    trainer.train()

    # The trainer's generator holds the latest weights after a sync; use it for a quick held-out check.
    trainer.vllm_generation.sync_weights()
    rows = task.eval_prompts()[:200]
    batch = trainer.rollout_generator.generate([r["prompt"] for r in rows], n=4, sampling_params=SamplingParams(
        temperature=1.0, max_new_tokens=4, seed=0))
    answers = [r["answer"] for r in rows for _ in range(4)]
    acc = task.accuracy([s.text for s in batch.samples], answers)
    print(f"held-out sampled accuracy after {args.steps} steps: {acc:.1%}")


if __name__ == "__main__":
    main()
