"""Weight sync for hand-written loops (`WeightSync`) and for any transformers Trainer (`WeightSyncCallback`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from torch import nn
from transformers import TrainerCallback

from rollout.rl.batch import RolloutBatch
from rollout.rl.generator import RolloutGenerator
from trainer_hooks.metrics import log_to_wandb, rollout_metrics

if TYPE_CHECKING:
    from rollout.distributed import RolloutPool, RolloutServerPool


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / accelerate / torch.compile wrappers."""
    try:
        from accelerate.utils import extract_model_from_parallel

        return extract_model_from_parallel(model)
    except ImportError:  # pragma: no cover - accelerate is a dependency
        while hasattr(model, "module"):
            model = model.module
        return model


class WeightSync:
    """Call after `optimizer.step()`: every `every` calls, the generator takes the model's new weights in place.

    The generator's KV cache stays allocated; the weight version it returns tags every token generated afterwards.
    A RolloutPool or RolloutServerPool works the same way: every worker takes the update, or none does.
    """

    def __init__(self, generator: RolloutGenerator | RolloutPool | RolloutServerPool, model: nn.Module,
                 every: int = 1, on_update: str = "keep"):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.generator = generator
        self.model = model
        self.every = every
        self.on_update = on_update
        self.calls = 0
        self.last_seconds: float | None = None

    def __call__(self) -> bool:
        """Count one optimizer step; sync when due. Returns whether weights were synced."""
        self.calls += 1
        if self.calls % self.every:
            return False
        self.sync()
        return True

    def sync(self) -> int:
        start = time.perf_counter()
        version = self.generator.update_weights(unwrap(self.model), on_update=self.on_update)
        self.last_seconds = time.perf_counter() - start
        return version

    def metrics(self, batch: RolloutBatch) -> dict:
        return rollout_metrics(batch, sync_seconds=self.last_seconds)

    def log(self, batch: RolloutBatch, step: int | None = None) -> dict:
        """Rollout metrics of `batch`, also logged to W&B when a run is active."""
        metrics = self.metrics(batch)
        log_to_wandb(metrics, step=step)
        return metrics


class WeightSyncCallback(TrainerCallback):
    """For any transformers Trainer: sync the generator (or a pool) from the trained model every `every` optimizer
    steps."""

    def __init__(self, generator: RolloutGenerator | RolloutPool | RolloutServerPool, every: int = 1,
                 on_update: str = "keep"):
        self.generator = generator
        self.every = every
        self.on_update = on_update
        self.last_seconds: float | None = None

    def _metrics(self) -> dict:
        return {"rollout/weight_sync_seconds": self.last_seconds,
                "rollout/weight_version": self.generator.weight_version}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None and state.global_step % self.every == 0:
            start = time.perf_counter()
            self.generator.update_weights(unwrap(model), on_update=self.on_update)
            self.last_seconds = time.perf_counter() - start
            log_to_wandb({**self._metrics(), "train/global_step": state.global_step})
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add the sync metrics to the trainer's log line and its log history."""
        if logs is not None and self.last_seconds is not None:
            logs.update(self._metrics())
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self._metrics())
        return control
