"""lockstep.engine: the rollout engine (continuous batching, chunked prefill, n-sample prefix
sharing, preemption by recompute, seeded sampling with rollout logprobs, weight updates).

    from lockstep.engine import Engine, GenerateRequest
"""

from lockstep.engine.engine import Engine
from lockstep.engine.request import GenerateRequest
from lockstep.engine.weight_update import WeightUpdateError

__all__ = ["Engine", "GenerateRequest", "WeightUpdateError"]
