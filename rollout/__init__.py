"""rollout: a continuous-batching generation engine with a paged KV cache, and an RL rollout layer on top.

The public names load on first use, so `import rollout` (and with it the `rollout` command's parser and --help)
does not pay for torch and transformers until something needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout import lazy_exports as _lazy

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncRollouts": "rollout.rl.async_rollouts",
    "ContinuousBatchingConfig": "rollout.config",
    "ContinuousBatchingManager": "rollout.manager",
    "EngineStats": "rollout.engine.core.stats",
    "ErrorKind": "rollout.engine.core.request",
    "InvalidRequestError": "rollout.validation",
    "ManagerError": "rollout.manager",
    "UnsupportedModelError": "rollout.engine.worker.model_runner",
    "LLMEngine": "rollout.engine",
    "RequestOutput": "rollout.engine",
    "RequestStatus": "rollout.engine",
    "RolloutBatch": "rollout.rl.batch",
    "RolloutGenerator": "rollout.rl.generator",
    "RolloutSample": "rollout.rl.batch",
    "SamplingParams": "rollout.sampling_params",
    "WeightUpdateError": "rollout.rl.weights",
    "continuous_batching_context_manager": "rollout.generate",
    "generate_batch": "rollout.generate",
    "init_continuous_batching": "rollout.generate",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from rollout.config import ContinuousBatchingConfig
    from rollout.engine import LLMEngine, RequestOutput, RequestStatus
    from rollout.engine.core.request import ErrorKind
    from rollout.engine.core.stats import EngineStats
    from rollout.engine.worker.model_runner import UnsupportedModelError
    from rollout.generate import continuous_batching_context_manager, generate_batch, init_continuous_batching
    from rollout.manager import ContinuousBatchingManager, ManagerError
    from rollout.rl.async_rollouts import AsyncRollouts
    from rollout.rl.batch import RolloutBatch, RolloutSample
    from rollout.rl.generator import RolloutGenerator
    from rollout.rl.weights import WeightUpdateError
    from rollout.sampling_params import SamplingParams
    from rollout.validation import InvalidRequestError


__getattr__, __dir__ = _lazy.lazy_exports("rollout", _EXPORTS, globals())


__all__ = sorted(_EXPORTS)
