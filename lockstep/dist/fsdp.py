"""FSDP2 data parallelism applied to the one model from outside (DESIGN principle 3).

    mesh = init_device_mesh("cpu", (world_size,))          # or dp_mesh(trainer_group)
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16)     # the model is still fp32 here
    trainer = Trainer(model, config, data_parallel=DataParallel(mesh.get_group()))

Units (`torch.distributed.fsdp.fully_shard`, innermost first; `plan_units` lists them):

    per decoder layer   each child holding low-precision parameters (DeepSeek-V4: the attention,
                        the MoE), param_dtype policy; then the layer itself with what is left (the
                        norms and mHC): fp32 policy when all of it is kept fp32, else param_dtype
    embedding           param_dtype (left in the root when its weight is tied to the LM head)
    final fp32 modules  one grouped unit (DeepSeek-V4: mHC's head and the final norm), fp32 policy
    root                param_dtype; holds the LM head: DeepSeek-V4's compute_logits reads
                        lm_head.weight without calling lm_head, so a unit of its own would never
                        be gathered

Which parameters stay fp32 is the model's rule (models/precision.py), the one `cast_model` applies
in a single-process bf16 run, so every gathered parameter has the dtype it has there. Why the fp32
modules are not inner units of their own (DISTRIBUTED.md's first sketch): FSDP passes a unit's
inputs through an identity autograd node (its post-backward hook); where that input has other
consumers (mHC's streams, the attention's projections feeding its norms), autograd then sums the
gradient contributions in another grouping, and the gradients stop being bitwise those of one
process (measured: ~1e-7 relative on every layer below the first such unit). The attention and the
MoE each take a tensor nothing else uses, so units there change no sum. Kept-fp32 parameters inside
a low-precision unit (the attention's `sinks` and norms, the compressors' `position_bias` and
norms: a few hundred values per layer) are left out of FSDP (`ignored_params`): replicated in fp32
on every rank, their gradients summed by the Trainer (`DataParallel.sum_grads`).

The sharded parameters stay fp32: they are the optimiser's master weights (MasterAdamW steps the
local shards in place). Gradients are reduced in fp32 as sums, not means
(`set_gradient_divide_factor(1.0)`; `set_force_sum_reduction_for_comms(True)`, since gloo has no
PREMUL_SUM): the Trainer normalises the loss by the global token / sample count, so the sum over
ranks is the gradient of the global loss, as one process accumulating the same micro-batches gets.
`offload=True`: `CPUOffloadPolicy`, sharded parameters, gradients and the optimiser step on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard, \
    register_fsdp_forward_method

from lockstep.dist.host_staged_comm import HostStagedAllGather, HostStagedReduceScatter
from lockstep.models.precision import keeps_fp32, model_tensors, storage_dtype
from lockstep.train.data_parallel import moves_cuda_over_gloo


def dp_mesh(group: ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D data-parallel mesh over an existing process group (e.g. the trainer group)."""
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp",))


def _rule_dtype(param_dtype: torch.dtype) -> torch.dtype:
    # the units do not depend on the run's dtype: an fp32 run shards as a bf16 run does
    return param_dtype if param_dtype == torch.float16 else torch.bfloat16


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise ValueError(f"apply_fsdp: {type(model).__name__} has no model.layers ModuleList")
    return inner


def _tied(model: nn.Module, weight: nn.Parameter) -> bool:
    return sum(p is weight for _, p in model.named_parameters(remove_duplicate=False)) > 1


@dataclass
class _Unit:
    modules: list[nn.Module]
    low: bool  # param_dtype policy; otherwise fp32
    params: list[str] = field(default_factory=list)  # the parameters it manages (full names)


def plan_units(model: nn.Module, param_dtype: torch.dtype = torch.bfloat16) -> list[_Unit]:
    """The FSDP units of `model`, innermost first, each with the parameters it manages (docstring)."""
    dtype = _rule_dtype(param_dtype)
    name_of = {id(p): n for n, p in model.named_parameters()}
    kept = {n for n in name_of.values() if keeps_fp32(model, n, dtype)}

    def has_low(m: nn.Module) -> bool:
        return any(name_of[id(p)] not in kept for p in m.parameters())

    decoder, units = _decoder(model), []
    for layer in decoder.layers:
        units += [_Unit([c], low=True) for c in layer.children() if has_low(c)]
        units.append(_Unit([layer], low=None))
    embed = getattr(decoder, "embed_tokens", None)
    if embed is not None and not _tied(model, embed.weight):
        units.append(_Unit([embed], low=True))
    tail = [c for c in decoder.children() if c is not embed and c is not decoder.layers and not has_low(c)]
    if tail:
        units.append(_Unit(tail, low=False))
    units.append(_Unit([model], low=None))
    claimed: set[int] = set()
    for u in units:
        for m in u.modules:
            u.params += [name_of[id(p)] for p in m.parameters() if id(p) not in claimed]
            claimed.update(id(p) for p in m.parameters())
        if u.low is None:  # a layer or the root: fp32 when what is left of it is all kept fp32
            u.low = any(n not in kept for n in u.params)
    return units


def replicated_fp32_params(model: nn.Module, param_dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Kept-fp32 parameters that fall in a low-precision unit: replicated, not sharded (docstring)."""
    dtype = _rule_dtype(param_dtype)
    return [n for u in plan_units(model, param_dtype) if u.low for n in u.params if keeps_fp32(model, n, dtype)]


def _check_fp32(model: nn.Module) -> None:
    # the sharded parameters are the master weights; MixedPrecisionPolicy casts the unsharded copies
    low = [n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if low:
        raise ValueError(f"apply_fsdp: parameters must be fp32 (the masters), {low[0]} is not; pass "
                         f"param_dtype instead of casting the model")


@torch.no_grad()
def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    # FSDP casts no buffers; cast the persistent ones as the single-process run (precision.cast_model) does
    tensors, _ = model_tensors(model)
    buffers = {n for n, _ in model.named_buffers()}
    for name, t in tensors.items():
        if name in buffers and t.is_floating_point():
            t.data = t.data.to(storage_dtype(model, name, dtype))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype = torch.float32,
               reduce_dtype: torch.dtype = torch.float32, offload: bool = False,
               host_staged: bool | None = None) -> nn.Module:
    """Shard `model` in place over `mesh` (1-D data parallel) as the module docstring says; returns it.

    `host_staged`: run the units' collectives on host copies (lockstep.dist.host_staged_comm);
    None: when the mesh moves CUDA tensors over gloo (ranks sharing a GPU)."""
    _check_fp32(model)
    units = plan_units(model, param_dtype)
    params = dict(model.named_parameters())
    replicated = {params[n] for n in replicated_fp32_params(model, param_dtype)}
    offload_policy: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload \
        else OffloadPolicy()
    policies = {True: MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                           cast_forward_inputs=False),
                False: MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                            cast_forward_inputs=False)}
    for u in units:
        fully_shard(u.modules if len(u.modules) > 1 else u.modules[0], mesh=mesh, mp_policy=policies[u.low],
                    offload_policy=offload_policy, ignored_params=replicated or None)
        for m in u.modules:
            _register_forward_methods(m)
    _cast_buffers(model, param_dtype)
    _sum_gradients(model)
    if host_staged if host_staged is not None else moves_cuda_over_gloo(mesh.get_group(), mesh.device_type):
        _stage_through_host(model)
    return model


def _stage_through_host(model: nn.Module) -> None:
    all_gather, reduce_scatter = HostStagedAllGather(), HostStagedReduceScatter()
    for m in fsdp_modules(model):
        m.set_custom_all_gather(all_gather)
        m.set_custom_reduce_scatter(reduce_scatter)


def _register_forward_methods(module: nn.Module) -> None:
    # DeepSeek-V4's decoder layer calls self_attn.forward_full (forward_rows in the true-on-policy
    # forward), not self_attn(...): without this the attention unit's hooks (gather before, reshard
    # after, reduce-scatter in backward) never fire
    for method in ("forward_full", "forward_rows"):
        if hasattr(module, method):
            register_fsdp_forward_method(module, method)


def fsdp_modules(model: nn.Module) -> Iterable[FSDPModule]:
    return (m for m in model.modules() if isinstance(m, FSDPModule))


def _sum_gradients(model: nn.Module) -> None:
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
