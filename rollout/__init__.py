"""rollout: a continuous-batching generation engine with a paged KV cache, and an RL rollout layer on top."""

from rollout.config import ContinuousBatchingConfig
from rollout.engine import LLMEngine, RequestOutput, RequestStatus
from rollout.generate import continuous_batching_context_manager, generate_batch, init_continuous_batching
from rollout.manager import ContinuousBatchingManager
from rollout.rl.generator import RolloutBatch, RolloutGenerator, RolloutSample
from rollout.rl.weights import WeightUpdateError
from rollout.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "LLMEngine",
    "RequestOutput",
    "RolloutBatch",
    "RolloutGenerator",
    "RolloutSample",
    "WeightUpdateError",
    "RequestStatus",
    "SamplingParams",
    "continuous_batching_context_manager",
    "generate_batch",
    "init_continuous_batching",
]
