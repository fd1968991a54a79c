"""Trainer integrations: TRL GRPO/RLOO on the rollout engine, weight-sync hooks, rollout metrics.

`RolloutGRPOTrainer` / `RolloutRLOOTrainer` need TRL and are imported lazily, so the hooks for hand-written loops work
without it.
"""

from trainer_hooks.metrics import log_to_wandb, rollout_metrics
from trainer_hooks.sync import WeightSync, WeightSyncCallback

__all__ = ["RolloutGRPOTrainer", "RolloutRLOOTrainer", "WeightSync", "WeightSyncCallback", "log_to_wandb",
           "rollout_metrics"]


def __getattr__(name):
    if name in ("RolloutGRPOTrainer", "RolloutRLOOTrainer", "RolloutTRLGeneration", "OLD_LOGPROB_MODES"):
        from trainer_hooks import trl as _trl

        return getattr(_trl, name)
    raise AttributeError(name)
