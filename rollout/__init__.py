"""rollout: a continuous-batching generation engine with a paged KV cache, and an RL rollout layer on top."""

from rollout.config import ContinuousBatchingConfig
from rollout.engine import LLMEngine, RequestOutput, RequestStatus
from rollout.generate import generate_batch
from rollout.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "ContinuousBatchingConfig",
    "LLMEngine",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "generate_batch",
]
