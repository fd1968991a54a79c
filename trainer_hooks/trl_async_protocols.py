"""TRL's own async GRPO trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`) on this engine: a rollout worker and
a weight transfer that implement its `RolloutWorkerProtocol` and `WeightTransferProtocol`.

    backend = RolloutServerPool(urls)          # or a RolloutGenerator, or a RolloutPool
    worker = RolloutWorker(backend, dataset, reward_funcs, groups_per_step=16, n=8, sampling_params=...,
                           max_staleness=args.max_staleness)
    trainer = AsyncGRPOTrainer(..., rollout_worker=worker, weight_transfer=RolloutWeightTransfer(worker))

The worker runs an `AsyncRollouts` producer and a pump thread that turns each finished group into TRL's
`RolloutSample`s (prompt + completion ids, a completion mask, the engine's sampling logprobs as `old_log_probs`,
GRPO's group-normalised advantage) on `rollout_buffer`. A sample's `model_version` is the version of its oldest
token in the trainer's numbering, so TRL's own staleness drop sees exactly what the producer bounds. Weights go to
the backend through the producer, in flight: the engine keeps generating while they land, so `pause` and `resume`
have nothing to do.

What runs here: every protocol method, driven the way TRL's trainer drives them (tests/trainer_hooks/
test_trl_async_protocols.py). What does not: TRL's AsyncGRPOTrainer itself, which needs vLLM, NCCL and a flash
attention kernel from the hub, none of which a CPU machine has.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from rollout.rl.async_rollouts import AsyncRollouts, ProducerError, ScoredGroup
from rollout.rl.backend import RolloutBackend
from rollout.rl.losses import group_advantages
from rollout.rl.rewards import RewardFunction
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PUT_POLL_S = 0.5  # how often a pump blocked on a full buffer re-checks that it should still run


def _rollout_sample_type():
    """TRL's RolloutSample, imported when a worker starts (trl.experimental warns on import)."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    return RolloutSample


class RolloutWorker:
    """TRL's RolloutWorkerProtocol over any RolloutBackend, fed by an AsyncRollouts producer."""

    def __init__(self, backend: RolloutBackend, prompts: Iterable, reward_funcs: RewardFunction |
                 Sequence[RewardFunction], groups_per_step: int, n: int = 8,
                 sampling_params: SamplingParams | None = None, max_staleness: int = 1, buffer_size: int = 0,
                 **producer_options) -> None:
        self.backend = backend
        self._producer_args = dict(prompts=prompts, reward_funcs=reward_funcs, groups_per_batch=groups_per_step, n=n,
                                   sampling_params=sampling_params, max_staleness=max_staleness, **producer_options)
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=buffer_size)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.producer: AsyncRollouts | None = None
        self._cv = threading.Condition()
        self._trainer_version = 0  # the version TRL says is live
        self._offset = 0  # TRL's version minus the backend's, fixed at each update_model_version
        self._stopping = False
        self._error: BaseException | None = None
        self._last_put = time.monotonic()
        self._pump: threading.Thread | None = None

    # ---------------------------------------------------------------- protocol
    def start(self) -> None:
        """Start generating (TRL calls it once, after the initial weight sync)."""
        if self._pump is not None:
            return
        self.producer = AsyncRollouts(self.backend, **self._producer_args)
        with self._cv:
            self._offset = self._trainer_version - self.producer.weight_version
        self._last_put = time.monotonic()
        self._pump = threading.Thread(target=self._run, name="rollout-trl-worker", daemon=True)
        self._pump.start()

    def stop(self) -> None:
        """Stop generating and free the backend's work in flight (TRL calls it on train end)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self.producer is not None:
            self.producer.close()
        if self._pump is not None:
            self._pump.join(60)

    def update_model_version(self, model_version: int) -> None:
        with self._cv:
            self._trainer_version = model_version
            if self.producer is not None:
                self._offset = model_version - self.producer.weight_version
            self._cv.notify_all()

    def check_health(self, stale_after_s: float) -> None:
        """RuntimeError if the producer failed, or nothing reached the buffer for `stale_after_s` seconds."""
        if self._error is not None:
            raise RuntimeError(f"the rollout worker stopped: {type(self._error).__name__}: {self._error}") \
                from self._error
        idle = time.monotonic() - self._last_put
        if self._pump is not None and idle > stale_after_s and self.rollout_buffer.empty():
            raise RuntimeError(f"the rollout worker produced nothing for {idle:.0f}s (stale_after_s={stale_after_s})")

    # ---------------------------------------------------------------- the pump
    def _run(self) -> None:
        sample_type = _rollout_sample_type()
        taken = 0
        try:
            while True:
                with self._cv:  # one batch per weight update, and max_staleness batches ahead of them
                    while not (self._stopping or taken - self.producer.updates <= self.producer.max_staleness):
                        self._cv.wait(_PUT_POLL_S)
                    if self._stopping:
                        return
                batch = self.producer.next_batch()
                if batch is None:
                    return
                taken += 1
                for group in batch.groups:
                    for sample in self._samples(sample_type, group):
                        self._put(sample)
                self.metrics_queue.put({k: v for k, v in batch.metrics.items()})
        except ProducerError as err:
            if not self._stopping:
                self._error = err
        except BaseException as err:  # surfaces through check_health
            logger.exception("the rollout worker's pump stopped")
            self._error = err

    def _put(self, sample) -> None:
        while not self._stopping:
            try:
                self.rollout_buffer.put(sample, timeout=_PUT_POLL_S)
                self._last_put = time.monotonic()
                return
            except queue.Full:
                continue

    def _samples(self, sample_type, group: ScoredGroup) -> Iterator:
        rewards = torch.tensor(group.rewards, dtype=torch.float64)
        advantages = group_advantages(rewards, [len(rewards)])
        with self._cv:
            version = group.oldest_version + self._offset
        metrics = {"reward": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0}
        prompt_text = group.row.get("prompt") if isinstance(group.row, dict) else group.row
        for i, (s, advantage) in enumerate(zip(group.samples, advantages.tolist())):
            prompt, completion = len(s.prompt_ids), len(s.completion_ids)
            yield sample_type(
                prompt=prompt_text, completion=s.text,
                input_ids=np.asarray(s.prompt_ids + s.completion_ids, dtype=np.int64),
                completion_mask=np.asarray([0] * prompt + [1] * completion, dtype=np.int64),
                old_log_probs=np.asarray([0.0] * prompt + list(s.logprobs), dtype=np.float32),
                advantage=float(advantage), model_version=version, group_id=group.index,
                metrics={**metrics, **{f"rewards/{name}": values[i] for name, values in group.reward_columns.items()}})


class RolloutWeightTransfer:
    """TRL's WeightTransferProtocol: the trainer's (name, tensor) stream goes to the backend through the worker's
    producer, landing in flight (so pause and resume do nothing)."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker

    def init_weight_transfer(self) -> None:
        """Nothing to set up: weights travel the backend's own way (in place, HTTP chunks, Ray's object store)."""

    def pause(self) -> None:
        """Nothing to pause: the update lands between two engine steps while generation goes on."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        target = self.worker.producer if self.worker.producer is not None else self.worker.backend
        target.update_weights(iterator)

    def resume(self) -> None:
        """Nothing to resume (see pause)."""

    def destroy(self) -> None:
        """Nothing to release: the worker's stop() ends generation."""
