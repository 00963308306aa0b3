"""The plan's activation bytes per token (plan/activations.py) against what lockstep's own
DeepSeek-V4 and Llama forwards keep for their backward, measured with saved-tensor hooks on the CPU.

Measured: every storage an autograd node saves during the forward of the decoder layers, counted
once, parameters excluded, and only while the node is alive at the end of the forward (a branch
no gradient reaches, the C4 indexer's top-k, is freed as soon as the forward leaves it: counting
at pack time would charge it). Two batches of the same length, 1 and 2 sequences: their difference
is one sequence's bytes, so what does not scale with the batch (fp32 copies of weights) cancels.
Sinkhorn runs as on a GPU, where the fused kernel keeps only its input (sinkhorn_triton.py); the
CPU loop keeps every step, which the plan, made for GPU runs, does not count. The head, measured
alike (what is saved after the last layer), runs as a GPU trainer runs it too: DeepSeek-V4's fp32
logits from the bf16 GEMM (Fp32Logits), the logprobs and entropies from the Triton kernel (under
the interpreter here), every position a response row.
"""

from __future__ import annotations

import pytest
import torch

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_config import CSA, HCA, SLIDING
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models import deepseek_v4
from lockstep.models.layers import hyper_connection
from lockstep.models.layers.fp32_logits import Fp32Logits
from lockstep.models.layers.logprob_entropy_triton import token_logprobs_and_entropy
from lockstep.models.layers.sinkhorn import sinkhorn_backward, sinkhorn_reference
from lockstep.models.llama import LlamaForCausalLM
from lockstep.models.llama_config import LlamaConfig
from lockstep.models.precision import cast_model
from lockstep.plan import activations as act
from lockstep.plan.hf_config import spec_from_config

# The plan leaves out per-token scraps (RoPE cos/sin, the norms' rsqrt, routing ids' scraps,
# masks): ~200-280 bytes per token of a DeepSeek-V4 layer whatever its width (the plan under by
# 275 B of tiny's 4,659, 208 of wide's 18,128; Llama's first layer, which computes the cos/sin all
# layers share, 128 B), next to nothing at real widths. SCRAPS + 3% leaves room for them; a missing
# or doubled term larger than that fails (the softmax, mHC's fp32 streams, the experts': 4-35% of
# a layer here; checked by dropping terms), a smaller one (q_res, routing ids) does not.
SCRAPS = 300
TOLERANCE = 0.03

CONFIGS = {
    # the tests' tiny config at the released rates: the plan knows C4 and C128 layers only
    "tiny": tiny_config(compress_rates={CSA: 4, HCA: 128}),
    "wide": tiny_config(vocab_size=64, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=8, head_dim=32, q_lora_rank=64, num_experts_per_tok=4,
                        n_routed_experts=16, o_groups=4, o_lora_rank=32, index_n_heads=4, index_head_dim=16,
                        index_topk=4, sliding_window=16, hc_mult=2, compress_rates={CSA: 4, HCA: 128},
                        layer_types=(SLIDING, CSA, HCA), mlp_layer_types=("hash_moe", "moe", "moe")),
    # sequences short against the window (RL's short responses): the trainer's dense attention form
    "short": tiny_config(compress_rates={CSA: 4, HCA: 128}, sliding_window=128),
    "llama": LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16),
}
SEQ = 256  # two closed blocks of the C128 layers


class _GpuSinkhorn(torch.autograd.Function):
    """Sinkhorn saving what the fused GPU kernel saves: its input only."""

    @staticmethod
    def forward(ctx, comb, iters, eps):
        ctx.save_for_backward(comb)
        ctx.iters, ctx.eps = iters, eps
        return sinkhorn_reference(comb, iters, eps)

    @staticmethod
    def backward(ctx, grad):
        return sinkhorn_backward(ctx.saved_tensors[0], grad, ctx.iters, ctx.eps), None, None


def _gpu_head(hidden, weight):
    """fp32_logits as on a GPU: the bf16 GEMM with fp32 output, which keeps the bf16 rows only."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return Fp32Logits.apply(flat, weight).view(*hidden.shape[:-1], weight.shape[0])


def _saved_bytes_per_layer(model, ids) -> list[int]:
    """Bytes of the storages saved by each decoder layer's forward and alive when it ends, then (one
    more entry) those saved after the last layer: the head, and the logprob kernel over its logits."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live: dict[tuple[int, int], list] = {}  # storage -> [references, bytes, layer]
    current = [None]

    class Ref:
        def __init__(self, t, key):
            self.t, self.key = t.detach(), key  # detached: an output saved with its grad_fn is a cycle

        def __del__(self):
            live[self.key][0] -= 1
            if not live[self.key][0]:
                del live[self.key]

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if current[0] is None or key[0] in params or not st.nbytes():
            return t
        live.setdefault(key, [0, st.nbytes(), current[0]])[0] += 1
        return Ref(t, key)

    hooks, layers = [], model.model.layers
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        # after the last layer, what is saved is the head's
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, i=i: current.__setitem__(0, len(layers) if i == len(layers) - 1 else None)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda r: r.t if isinstance(r, Ref) else r):
        logits = model(ids)
        logits = logits.reshape(-1, logits.shape[-1])
        out = token_logprobs_and_entropy(logits, ids.reshape(-1), with_entropy_grad=True)
    per_layer = [0] * (len(layers) + 1)
    for _, nbytes, layer in live.values():
        per_layer[layer] += nbytes
    del out, logits
    for h in hooks:
        h.remove()
    return per_layer


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_activations_match_lockstep_forward(name, monkeypatch):
    monkeypatch.setattr(hyper_connection, "sinkhorn", _GpuSinkhorn.apply)
    monkeypatch.setattr(deepseek_v4, "fp32_logits", _gpu_head)
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    llama = isinstance(cfg, LlamaConfig)
    model = LlamaForCausalLM(cfg) if llama else DeepseekV4ForCausalLM(cfg)
    if not llama:
        init_deepseek_v4_(model, seed=0)
    cast_model(model, torch.bfloat16)
    ids = torch.randint(2, cfg.vocab_size, (2, SEQ))
    one, two = _saved_bytes_per_layer(model, ids[:1]), _saved_bytes_per_layer(model, ids)
    spec = spec_from_config({**cfg.to_hf_dict(), "model_type": "llama" if llama else "deepseek_v4"})
    if not llama:
        assert [spec.layer_kind(i) for i in range(spec.num_layers)] == [
            {SLIDING: 0, CSA: 4, HCA: cfg.compress_rates[HCA]}[t] for t in cfg.layer_types]
    for i in range(spec.num_layers):
        measured = (two[i] - one[i]) / SEQ
        planned = act.layer_bytes_per_token(spec, i, 1, SEQ)
        assert abs(planned - measured) <= TOLERANCE * measured + SCRAPS, (name, i, planned, measured)
    # the head: the plan adds the logits' fp32 gradient, which the backward writes while they live
    measured = (two[-1] - one[-1]) / SEQ + cfg.vocab_size * act.F
    planned = act.head_bytes_per_token(spec, 1)
    assert abs(planned - measured) <= TOLERANCE * measured + SCRAPS, (name, "head", planned, measured)
