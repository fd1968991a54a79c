"""Trainer integrations: TRL GRPO/RLOO on the rollout engine, weight-sync hooks, rollout metrics.

`RolloutGRPOTrainer` / `RolloutRLOOTrainer` / `AsyncRolloutGRPOTrainer` need TRL and are imported lazily, so the
hooks for hand-written loops work without it.
"""

from trainer_hooks.metrics import log_to_wandb, rollout_metrics
from trainer_hooks.sync import WeightSync, WeightSyncCallback

__all__ = ["AsyncRolloutGRPOTrainer", "RolloutGRPOTrainer", "RolloutRLOOTrainer", "WeightSync", "WeightSyncCallback",
           "log_to_wandb", "rollout_metrics"]


def __getattr__(name):
    if name in ("RolloutGRPOTrainer", "RolloutRLOOTrainer", "RolloutTRLGeneration", "OLD_LOGPROB_MODES"):
        from trainer_hooks import trl as _trl

        return getattr(_trl, name)
    if name == "AsyncRolloutGRPOTrainer":
        from trainer_hooks import trl_async

        return trl_async.AsyncRolloutGRPOTrainer
    raise AttributeError(name)
