"""The engine core: requests, block pool, KV cache, scheduler, attention, model runner, sampler, and the step."""

from rollout.engine.core.request import Request, RequestOutput, RequestStatus
from rollout.engine.core.step import StepPlan
from rollout.engine.engine import LLMEngine

__all__ = ["LLMEngine", "Request", "RequestOutput", "RequestStatus", "StepPlan"]
