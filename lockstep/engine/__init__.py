"""lockstep.engine: the rollout engine.

engine.py          Engine: generate / generate_async, update_weights, pause / resume / abort / flush_cache
request.py         GenerateRequest; Sequence (one sample's runtime state) and RequestState (its n samples)
scheduler.py       continuous batching, chunked prefill, admission by cache memory, preemption by recompute
kv_cache.py        cache memory managers: DeepSeek-V4 fixed-size slots (+ copy_slot for n-sample sharing)
paged_cache.py     paged KV blocks with ref-counted prefix sharing (dense Llama / Qwen3)
runner.py          scheduled sequences -> model calls (DeepSeek-V4 StepBatch adapter), logits to sample
cuda_graph.py      decode forward captured as CUDA graphs per batch bucket (padding rows use a scratch slot)
transfer.py        host <-> device copies that do not stall the GPU (pinned, non_blocking)
sync_audit.py      counts device->host syncs of a block of code on any device (tests, benchmarks)
model_adapter.py   which adapter drives which model; the Llama paged-cache adapter
sampler.py         batched temperature / top-k / top-p / greedy, counter-based per-sequence seeds, logprobs
output.py          stop conditions and the Sample records of a finished request
serving_format.py  the served value of each weight under bf16 | fp8 | fp8-fp4
packed_weights.py  fp8 linears held packed (e4m3 + block scales, fp8 GEMM); the bytes the weights occupy
weight_update.py   validate-all-then-write weight updates (in memory or from disk)
background.py      the step-loop thread behind start() and generate_async

    from lockstep.engine import Engine, GenerateRequest
"""

from lockstep.engine.engine import Engine
from lockstep.engine.request import GenerateRequest
from lockstep.engine.weight_update import WeightUpdateError

__all__ = ["Engine", "GenerateRequest", "WeightUpdateError"]
