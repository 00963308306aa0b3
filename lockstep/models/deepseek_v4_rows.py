"""The true-on-policy forward of DeepSeek-V4: a token's logits have the same bits whether the
engine computed them in a decode step (any batch, any CUDA-graph bucket), in a prefill chunk, or
the trainer in a whole-sequence training forward (KernelSwitches.true_on_policy; issue 16).

Two rules make it so, on any device and in any dtype:
1. Everything a token computes on its own (mHC, norms, projections, RoPE, the MoE, the head) runs
   in row blocks of a fixed size (layers/row_blocks.py): every GEMM and reduction is called with
   the same shapes on every side, so a token's result cannot depend on how many others share its
   call. The routed experts (Experts.rows_mlp) run the Triton grouped kernels on CUDA in bf16
   (their launch config depends on N and K only), elsewhere dense: a GEMM over rows grouped by
   expert would have a size that depends on the neighbours' choices. On CUDA the same steps run
   over all rows in one call instead, with kernels whose sums are ordered by construction
   (whole_rows.py; the end of this docstring).
2. What a token reads from other tokens comes in a fixed layout (layers/key_tiles.py): its
   window in position order, then the compressed entries in fixed tiles, walked by one online
   softmax; compressed entries themselves are pooled in row blocks (Compressor.entries_from_slots),
   so a block pooled by a training forward and one closed by a decode step are the same entry.

Layer by layer (DeepseekV4DecoderLayer.forward given a key source instead of an attention
callable), tokens are flat rows [T] (B x S for training, N x S new tokens for a step):
    rows: mHC collapse, norm
    attention (DeepseekV4Attention.forward_rows, layers/attention_rows.py): projections, window +
        entry tiles, output projection
    rows: mHC combine, the MoE sub-block's mHC and norm
    MoE (MoE.forward row-blocks itself), then the mHC combine
The two callers differ only in where keys come from: `FullSequences` (training: each row's
sequence, from position 0) and `StepKeys` (the engine: window ring + new tokens, the caches'
entries, and the cache writes a step makes).

Training (DeepseekV4ForCausalLM._true_on_policy_logits): the loss reads this forward's values,
computed without autograd, and takes the gradient of the default forward run with the same experts
forced (`ExactValues`): the issue lets the backward use anything, and backpropagating through the
row blocks cost 2x the whole step. Pipeline stages do the same per stage (the row-block streams
travel beside the default ones, lockstep/dist/pipeline_parallel.py).

Cost: the per-block loop (on CUDA replayed from one captured graph per call, row_blocks.py: what
is left is ~500 small kernels per layer and block), the dense experts off CUDA (E / k times the
routed FLOPs), eager decode graphs, and in training the default forward beside this one. A
training forward skips the compressed-entry tiles a row cannot see yet (FullSequences.reach_groups).
On CUDA a layer and the head run over whole rows with fixed-order kernels instead
(KernelSwitches.fixed_order, whole_rows.py), their row-local steps compiled
(KernelSwitches.compile_rows, layers/compiled_rows.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .layers.compiled_rows import compiled_rows
from .layers.hyper_connection import hc_combine
from .layers.row_blocks import rows_forward
from .layers.whole_rows import kernels_run, linear, row_local, whole_rows


def _in_whole_rows(switched, x: torch.Tensor) -> bool:
    """Whether rows like x take the whole-rows forms: `switched`'s fixed_order switch is on and the
    fixed-order kernels run (whole_rows.py)."""
    return switched.kernels.on_for("fixed_order", x) and kernels_run(x)


def _compiling(switched, x: torch.Tensor):
    """compiled_rows() where `switched`'s compile_rows switch holds for rows like x
    (layers/compiled_rows.py)."""
    return compiled_rows() if switched.kernels.on_for("compile_rows", x) else nullcontext()


def _head_logits(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return linear(hidden, weight, fp32_out=True)


def _before_attention(layer, streams: torch.Tensor):
    collapsed, post, comb = layer.attn_hc(streams)
    return layer.input_layernorm(collapsed), post, comb


def _before_moe(layer, streams, attn_out, post, comb):
    streams = hc_combine(streams, attn_out, post, comb)
    collapsed, post, comb = layer.ffn_hc(streams)
    return streams, layer.post_attention_layernorm(collapsed), post, comb


def layer_rows(layer, streams: torch.Tensor, token_ids: torch.Tensor, keys, routing) -> torch.Tensor:
    """One decoder layer: streams [N, S, n, D], token_ids [N, S] (the rows of `keys`) -> streams.
    The attention and the MoE are each called once over all rows (they row-block inside), so a
    sharded unit gathers its weights once."""
    shape = streams.shape
    streams, ids = streams.reshape(-1, *shape[-2:]), token_ids.reshape(-1)
    whole = _in_whole_rows(layer.ffn_hc, streams)
    # the MoE, its experts and the compressors take their row-block paths; whole-rows steps compiled
    # where the layer's compile_rows switch is on
    with rows_forward(), _compiling(layer.ffn_hc, streams):
        h, post, comb = row_local(whole, _before_attention, streams, owner=layer)
        attn_out = layer.self_attn.forward_rows(h, keys, whole)
        streams, x, post, comb = row_local(whole, _before_moe, streams, attn_out, post, comb, owner=layer)
        forced = routing.forced_for(layer.layer_idx) if routing is not None else None
        forced = None if forced is None else forced.reshape(-1, forced.shape[-1])
        with whole_rows() if whole else nullcontext():  # the MoE decides there (MoE.forward)
            out, experts = layer.mlp(x, ids, forced)
    if routing is not None:
        routing.chosen.append(experts.view(*shape[:2], -1))
    with _compiling(layer.ffn_hc, streams):
        return row_local(whole, hc_combine, streams, out, post, comb).view(shape)


def hidden_rows(model, input_ids: torch.Tensor, keys, routing) -> torch.Tensor:
    """DeepseekV4Model's run through the true-on-policy forward: input_ids [N, S] (the rows of
    `keys`) -> final hidden states [N, S, H]."""
    streams = model.embed_streams(input_ids)
    for layer in model.layers:
        streams = layer(streams, input_ids, routing, keys)  # through __call__: hooks (FSDP) fire
    return final_rows(model, streams)


def final_rows(model, streams: torch.Tensor) -> torch.Tensor:
    """The last layer's streams [N, S, n, D] -> final hidden [N, S, D] (mHC head, norm) in row blocks."""
    flat = streams.reshape(-1, *streams.shape[-2:])
    whole = _in_whole_rows(model.hc_head, flat)
    with _compiling(model.hc_head, flat):
        # the class's function, not the bound method: one object for every call (compiled_rows.call)
        return row_local(whole, type(model).final_hidden, flat, owner=model).view(*streams.shape[:-2], flat.shape[-1])


class ExactValues(torch.autograd.Function):
    """`exact`'s values with `fast`'s gradient: the trainer's loss reads the true-on-policy logits, its
    backward runs through the default forward's graph (same weights, the same experts forced)."""

    @staticmethod
    def forward(ctx, fast: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        return exact

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def runs_true_on_policy(layer) -> bool:
    """Whether a decoder layer was switched to the true-on-policy forward (KernelSwitches)."""
    return layer.ffn_hc.kernels.on("true_on_policy")


def logits_rows(model, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] -> logits [..., V] fp32: model's LM head as an fp32 GEMM in row blocks, or over
    whole rows as the fixed-order GEMM with fp32 output (bf16 products are exact in fp32: the terms
    of the upcast GEMM, summed in the kernel's fixed order)."""
    weight = model.lm_head.weight
    flat = hidden.reshape(-1, hidden.shape[-1])
    whole = _in_whole_rows(model.model.hc_head, flat)
    with _compiling(model.model.hc_head, flat):
        logits = row_local(whole, _head_logits, flat, owner=weight)
    return logits.view(*hidden.shape[:-1], weight.shape[0])
