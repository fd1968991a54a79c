"""AsyncRolloutGRPOTrainer: TRL's GRPOTrainer fed by an `AsyncRollouts` producer, so generation never waits for the
optimizer.

Each training generation step takes the next groups the producer finished (at most `rollout_max_staleness` weight
versions old) instead of generating the dataloader's prompts, and hands them to TRL's own pipeline: TRL computes the
rewards, the advantages, the old logprobs (recomputed: tokens come from older weights, so TRL's recompute is the
proximal policy of decoupled PPO) and its importance-sampling correction from the engine's sampling logprobs
(`vllm_importance_sampling_mode` and its caps). Weights go to the running engine through the producer, which keeps
generating meanwhile. The producer draws its own prompts from the train dataset (shuffled once per pass, with the
trainer's seed); the dataloader's batches only pace the steps.

Not supported yet: several processes, tools and environments, custom rollout functions, vision-language models,
`share_weights=True` (training would change the weights running groups read).
"""

from __future__ import annotations

import logging

import torch

from rollout.rl.async_rollouts import AsyncBatch, AsyncRollouts
from rollout.rl.batch import RolloutBatch
from rollout.thread_teams import split_threads
from trainer_hooks.trl import RolloutGRPOTrainer, RolloutTRLGeneration

logger = logging.getLogger(__name__)

PROMPT_IDS_KEY = "_rollout_prompt_ids"  # the row's prompt as TRL tokenizes it, what the producer generates from


class AsyncRolloutTRLGeneration(RolloutTRLGeneration):
    """The adapter of AsyncRolloutGRPOTrainer: weights go through the producer, and a training step's samples are
    the batch the trainer took from it (evaluation still generates its own prompts)."""

    producer: AsyncRollouts | None = None
    taken: AsyncBatch | None = None

    def _push(self, source) -> None:
        (self.producer or self.backend).update_weights(source)

    def _rollouts(self, prompts) -> RolloutBatch:
        taken, self.taken = self.taken, None
        if taken is None:
            return super()._rollouts(prompts)
        batch = taken.rollouts
        if [list(p) for p in prompts] != [s.prompt_ids for s in batch.samples]:
            raise RuntimeError("TRL tokenized the producer's prompts differently from how they were generated; "
                               "this setup (chat template, special tokens) is not supported by the async trainer")
        return batch


class AsyncRolloutGRPOTrainer(RolloutGRPOTrainer):
    """RolloutGRPOTrainer with generation running ahead of the optimizer. Extra arguments: `rollout_max_staleness`
    (weight versions a sample's oldest token may lag the trained weights, default 1; see rollout.rl.staleness) and
    `rollout_engine_threads` (on a CPU, the engine's intra-op threads; the trainer keeps the rest; default half)."""

    generation_class = AsyncRolloutTRLGeneration

    def __init__(self, *args, rollout_max_staleness: int = 1, rollout_engine_threads: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        reasons = [why for why, present in [
            ("several processes", self.accelerator.num_processes > 1),
            ("tools", bool(getattr(self, "tools", None))),
            ("environments", getattr(self, "environment_factories", None) is not None),
            ("a custom rollout_func", getattr(self, "rollout_func", None) is not None),
            ("vision-language models", getattr(self, "_is_vlm", False))] if present]
        if reasons:
            raise NotImplementedError(f"AsyncRolloutGRPOTrainer does not support {', '.join(reasons)} yet; use "
                                      "RolloutGRPOTrainer")
        if self.vllm_generation.share_weights:
            raise ValueError("AsyncRolloutGRPOTrainer needs share_weights=False: training would change the weights "
                             "that running groups read")
        self.rollout_max_staleness = rollout_max_staleness
        self.rollout_engine_threads = rollout_engine_threads
        self.rollout_producer: AsyncRollouts | None = None

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation generates its own prompts, synchronously
            return super()._generate_and_score_completions(inputs)
        if self.state.global_step != self._last_loaded_step:  # TRL's lazy sync, before the batch is taken
            self.vllm_generation.sync_weights()
            self._last_loaded_step = self.state.global_step
        if self.rollout_producer is None:
            self.rollout_producer = self._start_producer(len(inputs))
            self.vllm_generation.producer = self.rollout_producer
        batch = self.rollout_producer.next_batch()
        for key, value in batch.metrics.items():
            self._metrics["train"][key].append(value)
        self.vllm_generation.taken = batch
        rows = [{k: v for k, v in g.row.items() if k != PROMPT_IDS_KEY} for g in batch.groups for _ in g.samples]
        return super()._generate_and_score_completions(rows)

    def _start_producer(self, rows_per_step: int) -> AsyncRollouts:
        groups = rows_per_step // self.num_generations
        return AsyncRollouts(self.rollout_backend, self._prompt_rows(), None, groups_per_batch=groups,
                             n=self.num_generations, sampling_params=self.vllm_generation.sampling_params,
                             max_staleness=self.rollout_max_staleness, prompt_key=PROMPT_IDS_KEY,
                             engine_threads=self._split_cpu_threads(), seed=self.args.seed)

    def _split_cpu_threads(self) -> int | None:
        """On a CPU the engine and the trainer run at once: give the engine `rollout_engine_threads` (default half)
        and the trainer the rest, so the two OpenMP teams never hold more threads than there are cores."""
        if self.accelerator.device.type != "cpu" or self.rollout_backend.shared_by_processes:
            return self.rollout_engine_threads
        engine, trainer = split_threads(torch.get_num_threads(), self.rollout_engine_threads or None,
                                        "rollout_engine_threads")
        torch.set_num_threads(trainer)
        logger.info("async GRPO on CPU: %d intra-op thread(s) for the engine, %d for the trainer", engine,
                    torch.get_num_threads())
        return engine

    def _prompt_rows(self):
        """The train dataset's rows without end, shuffled once per pass, each with its prompt tokenized by TRL."""
        data = self.train_dataset
        epoch = 0
        while True:
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(self.args.seed + epoch))
            for i in order.tolist():
                row = dict(data[i])
                prompt_ids, _, _ = self._tokenize_prompts([row["prompt"]])
                yield {**row, PROMPT_IDS_KEY: list(prompt_ids[0])}
            epoch += 1

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # stopping the trainer stops generation and frees the KV it held
            if self.rollout_producer is not None:
                self.rollout_producer.close()
                self.rollout_producer = None
                self.vllm_generation.producer = None
