"""Which of lockstep's optional kernels a model may run: the one place the switches are decided.

The forward-only Triton kernels (grouped_gemm_triton.py: the routed experts at decode;
hc_projection_triton.py and hc_pre_triton.py: mHC's pre stage at decode; step_attention_triton.py: the
core attention at decode; router_triton.py: the top-k router at decode; compressor_step_triton.py: the
entry a decode step closes) and the compiled mHC
coefficients (hyper_connection.hc_coefficients) change the rounding of a token's logprob, so they are
settings, not environment: `EngineConfig` carries one field each
(triton_moe, triton_hc, triton_attention, triton_router, triton_compressor, triton_sampler, compile_hc) and
`TrainConfig` compile_hc (the Triton kernels act on single-token steps, which the trainer's forward
never takes); the engine and the trainer hand them to their model with `set_kernel_switches` at
construction (the model imports neither config: DESIGN principle 3). A model nobody configured
runs the defaults (the kernels on, true_on_policy off).

`true_on_policy` (EngineConfig / TrainConfig.true_on_policy) selects the true-on-policy forward
(deepseek_v4_rows.py), which engine and trainer must run alike: it switches the four side-specific
kernels and the trainer's fused logprobs off, whatever their setting or environment. The configs'
None (their default) means `decide_true_on_policy`: on CUDA, where the model has that forward.

The environment overrides a setting when set, for A/B runs without touching a config:
LOCKSTEP_TRITON_MOE, LOCKSTEP_TRITON_HC, LOCKSTEP_TRITON_ATTENTION, LOCKSTEP_TRITON_SAMPLER, LOCKSTEP_COMPILE,
LOCKSTEP_TRUE_ON_POLICY, LOCKSTEP_FIXED_ORDER, LOCKSTEP_COMPILE_ROWS, LOCKSTEP_FLASH_ATTENTION, LOCKSTEP_TRITON_NORM,
LOCKSTEP_TRITON_ROPE, LOCKSTEP_TRITON_COMBINE, LOCKSTEP_FUSED_LOGPROBS, LOCKSTEP_TRITON_INDEX ("0" off, anything else
on; LOCKSTEP_COMPILE also switches off the engine's compiled decoder layers). The engine's startup line says which
kernels are on.

A Triton kernel runs only where it can: on CUDA (under TRITON_INTERPRET=1 the tests run the
kernels themselves, not this gate), with no gradient wanted (no backward), and where each caller's
shape checks pass.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import nn

# each switch's environment override
ENV = {"triton_moe": "LOCKSTEP_TRITON_MOE", "triton_hc": "LOCKSTEP_TRITON_HC",
       "triton_attention": "LOCKSTEP_TRITON_ATTENTION", "triton_router": "LOCKSTEP_TRITON_ROUTER",
       "triton_compressor": "LOCKSTEP_TRITON_COMPRESSOR", "triton_sampler": "LOCKSTEP_TRITON_SAMPLER",
       "compile_hc": "LOCKSTEP_COMPILE",
       "true_on_policy": "LOCKSTEP_TRUE_ON_POLICY", "fixed_order": "LOCKSTEP_FIXED_ORDER",
       "compile_rows": "LOCKSTEP_COMPILE_ROWS", "flash_attention": "LOCKSTEP_FLASH_ATTENTION",
       "triton_norm": "LOCKSTEP_TRITON_NORM", "triton_rope": "LOCKSTEP_TRITON_ROPE",
       "triton_combine": "LOCKSTEP_TRITON_COMBINE", "fused_logprobs": "LOCKSTEP_FUSED_LOGPROBS",
       "triton_index": "LOCKSTEP_TRITON_INDEX"}
# the kernels a decode step and a training forward run differently, and the trainer's fused logprobs
# (the engine samples with torch's log_softmax): off in the true-on-policy forward
_SIDE_SPECIFIC = ("triton_moe", "triton_hc", "triton_attention", "triton_router", "triton_compressor",
                  "triton_sampler", "compile_hc", "fused_logprobs")
# switches that act only where a gradient is wanted: the engine never runs them (its startup line omits them)
TRAINER_ONLY = ("flash_attention", "triton_norm", "triton_rope", "triton_combine", "fused_logprobs")


def trainer_kernels(on) -> dict[str, bool]:
    """The TRAINER_ONLY switches with exactly those in `on` on (the benchmarks' kernel rows)."""
    unknown = set(on) - set(TRAINER_ONLY)
    if unknown:
        raise ValueError(f"unknown trainer kernel switches {sorted(unknown)}; known: {', '.join(TRAINER_ONLY)}")
    return {name: name in on for name in TRAINER_ONLY}


def env_override(variable: str, configured: bool | None) -> bool | None:
    """`configured`, unless the environment variable is set: then whether it is not "0"."""
    value = os.environ.get(variable)
    return configured if value is None else value != "0"


@dataclass(frozen=True)
class KernelSwitches:
    triton_moe: bool = True
    """The routed experts of a decode step take the Triton grouped GEMMs (SwiGLU fused)."""
    triton_hc: bool = True
    """mHC's projection + RMSNorm of a decode step is one Triton kernel, and the rest of its pre
    stage (coefficients, Sinkhorn, collapse) another (hc_pre_triton.py)."""
    triton_attention: bool = True
    """A decode step's core attention (scores, softmax with the sink, P V) is one Triton kernel that
    reads the keys where they are cached (step_attention_triton.py)."""
    triton_router: bool = True
    """A decode step's top-k router is one Triton kernel (router_triton.py): 15.5 us against the
    compiled torch ops' 21.4 on an H200 (EngineConfig.triton_router)."""
    triton_compressor: bool = True
    """The entry a decode step's token closes is one Triton kernel reading the compressor's open block
    in place, and only the token is written to it (compressor_step_triton.py)."""
    triton_sampler: bool = True
    """The engine's draw of a batch of one temperature that truncates nothing (greedy or sampled, its tokens
    and logprobs) is two or three Triton kernels (engine/draw_triton.py); read by the engine's sampler, not
    the model."""
    compile_hc: bool = True
    """On CUDA, mHC's coefficients are compiled (fused) outside compiled regions."""
    true_on_policy: bool = False
    """The true-on-policy forward (deepseek_v4_rows.py): a token's logprob has the same bits in the
    engine (any batch, chunk or CUDA-graph bucket) and in the trainer. Switches the ones above off."""
    fixed_order: bool | None = None
    """In the true-on-policy forward, the mHC and norm steps run over all rows at once with the
    fixed-order kernels (whole_rows.py) instead of in row blocks. None: on CUDA (measured on an H200:
    the same bits as the row blocks' guarantee, decode as fast, prefill and training faster); True:
    also under Triton's interpreter (the CPU tests; slow); False: row blocks. Engine and trainer
    must agree on it (LOCKSTEP_FIXED_ORDER, "0" or "1", sets both in one process)."""
    triton_index: bool | None = False
    """The C4 indexer's scores in every forward (training, the trainer's logprob passes, the engine's
    steps) as one Triton kernel (index_scores_triton.py, the true-on-policy forward's) instead of
    einsum, ReLU, weights and head sum over a [N, S, H_I, E] fp32 tensor: a row's scores, so its
    picks, then do not depend on the batch's shape. None: on CUDA; True: also under Triton's
    interpreter (the CPU tests); False (the default): the torch ops, as fast (an H200's graphed 1b train
    step: 159,567 tok/s with the kernel, 162,350 without, 2026-12-04). Engine and trainer must agree on
    it (LOCKSTEP_TRITON_INDEX, "0" or "1", sets both in one process)."""
    compile_rows: bool | None = None
    """Over whole rows, the row-local steps run compiled (layers/compiled_rows.py): inductor on CUDA,
    the fixed-order kernels opaque inside. None: on CUDA (measured on an H200, 1b config: engine ==
    trainer bitwise in bf16 / fp8 / fp8-fp4 serving, rollout 0.89x of the compiled default against
    0.32x uncompiled); True: also on the CPU (dynamo's trace without code generation: what
    the CPU tests check; slow). Engine and trainer must agree on it (LOCKSTEP_COMPILE_ROWS)."""

    # The trainer's Triton kernels, each with its backward (TRAINER_ONLY): None (the default) on CUDA in
    # bf16, True also under the interpreter (the CPU tests), False off (triton_support.trainer_kernel_takes).
    # Measured on an H200 (1b config, 8 x 2048 tokens): all five 1.64x the eager ops' train step.
    flash_attention: bool | None = None
    """The trainer's attention (eager CUDA bf16 forward with gradients) as flash-style Triton kernels,
    forward and backward (flash_sink_attention_triton.py; TrainConfig.flash_attention)."""
    triton_norm: bool | None = None
    """The trainer's RMSNorms (eager forward with gradients, CUDA bf16) as Triton kernels, forward
    and backward (rms_norm_grad_triton.py; TrainConfig.triton_norm)."""
    triton_rope: bool | None = None
    """The trainer's rotary embeddings (the attention's q, kv and output, the compressors' entries, the
    indexer's queries; eager forward with gradients, CUDA bf16) as one Triton kernel each way
    (rope_triton.py; TrainConfig.triton_rope)."""
    triton_combine: bool | None = None
    """The trainer's routed-expert combine (eager forward with gradients, CUDA bf16) as one Triton
    kernel each way, reading the grouped GEMMs' outputs in place, and the dispatch's gradient as one
    (moe_combine_triton.py; TrainConfig.triton_combine)."""
    fused_logprobs: bool | None = None
    """The trainer's token logprobs and entropies from the fp32 logits (CUDA) as one Triton kernel each
    way (logprob_entropy_triton.py; TrainConfig.fused_logprobs); read by the trainer, not the model.
    Off in the true-on-policy forward (its logprobs must be the engine's bits)."""

    def on(self, name: str) -> bool | None:
        """Whether switch `name` is on: the setting, or its environment variable when set (None:
        a device-dependent default, `on_for`)."""
        if name in _SIDE_SPECIFIC and self.on("true_on_policy"):
            return False
        return env_override(ENV[name], getattr(self, name))

    def on_for(self, name: str, x: torch.Tensor) -> bool:
        """Whether switch `name` holds for activations like x (a device-dependent switch's None: on
        CUDA only)."""
        setting = self.on(name)
        return x.is_cuda if setting is None else setting

    def describe(self, omit: tuple[str, ...] = ()) -> str:
        """e.g. "triton_moe on, triton_hc off (LOCKSTEP_TRITON_HC), compile_hc on"; `omit`: switches left out."""
        parts = []
        for f in dataclasses.fields(self):
            if f.name in omit:
                continue
            on, env = self.on(f.name), os.environ.get(ENV[f.name])
            state = "on CUDA" if on is None else "on" if on else "off"
            parts.append(f"{f.name} {state}" + (f" ({ENV[f.name]}={env})" if env is not None else ""))
        return ", ".join(parts)


DEFAULT = KernelSwitches()


def decide_true_on_policy(setting: bool | None, model: nn.Module, device, excluded_by: str | None) -> bool:
    """EngineConfig / TrainConfig.true_on_policy decided once, at the side's construction: the setting,
    or for None on CUDA where the model has the forward and no field of that config rules it out
    (`excluded_by`: packed weights, expert parallel). Measured on an H200 (1b config) at 0.92x of the
    compiled default's rollout tokens/s and 0.78-0.83x of the eager default's train step; on the CPU it
    runs in row blocks, 0.48x of a train step (cpu-tiny, train_throughput.py): off there."""
    if setting is not None:
        return setting
    return hasattr(model, "true_on_policy") and torch.device(device).type == "cuda" and excluded_by is None


class Switched:
    """Mixin of the modules that ask a switch: `self.kernels`, the defaults until set from outside."""

    kernels: KernelSwitches = DEFAULT


def set_kernel_switches(model: nn.Module, switches: KernelSwitches) -> nn.Module:
    """Every switched module of `model` runs with `switches`. Returns the model."""
    for module in model.modules():
        if isinstance(module, Switched):
            module.kernels = switches
    return model


def grad_wanted(*tensors: torch.Tensor) -> bool:
    """Autograd will record an op on `tensors`: grad mode on and one of them requires a gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def forward_kernel_allowed(enabled: bool, *tensors: torch.Tensor) -> bool:
    """A forward-only kernel may run: switched on, on CUDA, no gradient wanted through `tensors`."""
    if not enabled or not tensors[0].is_cuda:
        return False
    return not grad_wanted(*tensors)
