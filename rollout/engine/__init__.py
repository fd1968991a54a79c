"""The engine core: requests, block pool, KV cache, scheduler, attention, model runner, sampler, and the step."""

from rollout.engine.engine import LLMEngine
from rollout.engine.request import Request, RequestOutput, RequestStatus
from rollout.engine.step import StepPlan

__all__ = ["LLMEngine", "Request", "RequestOutput", "RequestStatus", "StepPlan"]
