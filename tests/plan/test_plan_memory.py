"""Actor memory terms of a tiny Llama on TP2 x PP2, worked out by hand."""

from dataclasses import replace

import pytest

from lockstep.plan import activations as act
from lockstep.plan.layout import make_layout
from lockstep.plan.memory import actor_memory, per_gpu_params, stage_groups

# Tiny Llama: H 64, 4 layers, 4 heads x 16, 2 KV heads, MLP 128, vocab 1000 (untied).
TP_PER_LAYER = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k+v, o, MLP: split over TP
REPL_PER_LAYER = 2 * 64  # the two RMSNorm weights
STAGE0 = 1000 * 64 / 2 + 2 * (TP_PER_LAYER / 2 + REPL_PER_LAYER)  # embed/TP + layers 0, 1
STAGE1 = 2 * (TP_PER_LAYER / 2 + REPL_PER_LAYER) + 64 + 1000 * 64 / 2  # layers 2, 3 + norm + head/TP
LOGITS = 288_768
# Per token per layer, 32-token sequences, bytes: per sub-block RMSNorm (fp32 input, bf16 output, rsqrt) and
# block input; fp32 q/k/v, causal mask, fp32 softmax and its nan_to_num, attention out; SwiGLU (4 x I).
ACT_PER_TOKEN = (2 * (64 * 4 + 64 * 2 + 4 + 64 * 2) + (4 + 2 * 2) * 16 * 4 + 32 + 2 * 4 * 32 * 4 + 4 * 16 * 2
                 + 4 * 128 * 2)
ACT_TP2 = (ACT_PER_TOKEN - 32) / 2 + 32  # the mask is whole on every TP rank


def _terms(stage):
    return {t.name: t.bytes for t in stage.terms}


def test_activation_bytes_per_token(tiny_llama, tiny_v4):
    assert sum(t.bytes_per_token for t in act.layer_terms(tiny_llama, 0, 32)) == ACT_PER_TOKEN == 3752
    assert act.layer_bytes_per_token(tiny_llama, 0, 2, 32) == ACT_TP2 == 1892
    # V4 with recompute keeps the n = 2 mHC streams: 2 * 64 * 2 B per token.
    assert act.recompute_bytes_per_token(tiny_v4, 1) == 256
    # V4 C4 layer, TP 1, 32-token sequences: blocks of 8 query rows, each scoring 24 keys
    # (8 window + 8 block positions + 8 entries).
    # mHC per sub-block: the projection's 1/rms, bf16 streams, coefficients, combine, block norm
    mhc = 4 + 2 * 64 * 2 + (4 * 2 + 2 + 4) * 4 + (64 * 2 + 6 * 2) + 2 * 64 * 4
    # input, q_a norm, q_res, q norm, kv norm, q, keys, softmax, probs + argmax, un-roped out, o_a out
    attn = (64 * 2 + 2 * 16 * 4 + 16 * 2 + (128 * 4 + 4 * 4) + 2 * 32 * 4 + 128 * 2 + 24 * 32 * 2 / 8
            + 4 * 25 * 4 + (4 * 24 * 2 + 4 * 8) + 128 * 2 + 16 * 2)
    c4 = 2 * 32 * (2 + 4 + 2) + 2 * 32 * 4 / 4  # pooling (kv, fp32 + bf16 weights), entry norm
    # router fp32, routing ids, dispatched, expert SwiGLU, expert outputs, shared input + SwiGLU
    moe = (64 * 4 + 2 * 8 * 4) + 2 * 28 + 2 * 64 * 2 + 2 * 16 * 12 + 2 * 64 * 6 + 64 * 2 + 16 * 12
    assert act.layer_bytes_per_token(tiny_v4, 2, 1, 32) == 2 * mhc + attn + c4 + moe == 7048
    # at 36 tokens: 9 entries (one more key per block) and 40 query rows (padded to whole blocks),
    # so the per-row terms (q, keys, softmax, probabilities + argmax) grow by 40 / 36
    per_row = 128 * 2 + 25 * 32 * 2 / 8 + 4 * 26 * 4 + 4 * 25 * 2 + 4 * 8
    assert act.layer_bytes_per_token(tiny_v4, 2, 1, 36) - 7048 == pytest.approx(
        per_row * 40 / 36 - (128 * 2 + 24 * 32 * 2 / 8 + 4 * 25 * 4 + 4 * 24 * 2 + 4 * 8))


def test_params_per_gpu(tiny_llama, small_cluster, small_train):
    lay = make_layout(tiny_llama, small_cluster, small_train, tp=2, pp=2, ep=1, cp=1)
    assert (lay.dp, lay.edp) == (1, 2)
    assert per_gpu_params(stage_groups(tiny_llama, lay, 0, range(0, 2)), lay) == (STAGE0, 0)
    assert per_gpu_params(stage_groups(tiny_llama, lay, 1, range(2, 4)), lay) == (STAGE1, 0)


def test_memory_terms_no_recompute(tiny_llama, small_cluster, small_train):
    lay = make_layout(tiny_llama, small_cluster, small_train, tp=2, pp=2, ep=1, cp=1)
    s0, s1 = actor_memory(tiny_llama, small_cluster, small_train, lay)
    # 256 tokens per step / (DP 1 x 64 tokens) = 4 micro-batches; 1F1B: stage 0 holds 2, stage 1 holds 1.
    t0, t1 = _terms(s0), _terms(s1)
    assert t1["weights"] == STAGE1 * 2
    assert t1["gradients"] == STAGE1 * 4
    assert t1["optimizer states"] == STAGE1 * 12
    assert t0["activations"] == 2 * 2 * 64 * ACT_TP2
    assert t1["activations"] == 1 * 2 * 64 * ACT_TP2
    # head: final norm (fp32 in, bf16 out), the head's bf16 input, V/TP fp32 logits and their gradient per token
    assert t1["logits"] == LOGITS == 64 * (64 * 4 + 64 * 2 + 64 * 2 + 1000 / 2 * 4 * 2)
    assert "logits" not in t0
    assert s1.gpu_bytes == STAGE1 * 18 + 2 * 64 * ACT_TP2 + LOGITS


def test_memory_terms_recompute_offload_and_dp(tiny_llama, small_cluster, small_train):
    train = replace(small_train, recompute=True, optimizer_offload=True)
    lay = make_layout(tiny_llama, small_cluster, train, tp=1, pp=2, ep=1, cp=1)  # DP 2
    s0, _ = actor_memory(tiny_llama, small_cluster, train, lay)
    p0 = 1000 * 64 + 2 * (TP_PER_LAYER + REPL_PER_LAYER)
    t0 = _terms(s0)
    # 256 / (2 x 64) = 2 micro-batches, so stage 0 holds min(PP=2, 2) = 2 layer inputs per layer.
    assert t0["activations (recompute: layer inputs)"] == 2 * 2 * 64 * 64 * 2
    assert t0["recompute working set"] == 64 * ACT_PER_TOKEN
    assert t0["optimizer states (offloaded)"] == 0
    assert t0["host: optimizer states"] == pytest.approx(p0 / 2 * 12)
    assert t0["host: gradient shard"] == pytest.approx(p0 / 2 * 4)
    assert s0.gpu_bytes == pytest.approx(p0 * 6 + 2 * 2 * 64 * 128 + 64 * ACT_PER_TOKEN)


def test_bf16_grads_and_plain_optimizer(tiny_llama, small_cluster, small_train):
    train = replace(small_train, grad_dtype="bf16", distributed_optimizer=False, optimizer_dtype="bf16")
    lay = make_layout(tiny_llama, small_cluster, train, tp=1, pp=1, ep=1, cp=1)  # DP 4
    t = _terms(actor_memory(tiny_llama, small_cluster, train, lay)[0])
    p = 276_032
    assert t["gradients"] == p * 2
    assert t["optimizer states"] == p * (4 + 2 + 2)  # not sharded over DP without the distributed optimizer


def test_kl_loss_adds_one_copy_of_the_weights(tiny_llama, small_cluster, small_train):
    lay = make_layout(tiny_llama, small_cluster, small_train, tp=2, pp=2, ep=1, cp=1)
    plain = actor_memory(tiny_llama, small_cluster, small_train, lay)[1]
    kl = actor_memory(tiny_llama, small_cluster, replace(small_train, use_kl_loss=True), lay)[1]
    assert "reference weights" not in _terms(plain)
    assert _terms(kl)["reference weights"] == STAGE1 * 2  # bf16, sharded as the actor's weights
    assert kl.gpu_bytes == plain.gpu_bytes + STAGE1 * 2


def test_one_micro_batch_peaks_on_activations_or_gradients_not_both(tiny_v4, small_cluster, small_train):
    """lockstep's backward allocates gradients as it frees activations (no gradient buffer): with one
    micro-batch per GPU the peak holds the larger; with two, the second forward runs beside the first's
    accumulated gradients, so both count."""
    lay = make_layout(tiny_v4, small_cluster, small_train, tp=1, pp=1, ep=1, cp=1)  # DP 4
    for tokens, mbs in ((64, 1), (32, 2)):  # 256 tokens per step over DP 4
        train = replace(small_train, max_tokens_per_gpu=tokens)
        assert train.micro_batches(lay.dp, lay.cp) == mbs
        (s,) = actor_memory(tiny_v4, small_cluster, train, lay)
        t = _terms(s)
        assert "MoE dispatch buffers" not in t  # EP 1: no rows leave the GPU
        forward = t["activations"] + t["logits"]
        states = t["weights"] + t["gradients"] + t["optimizer states"]
        if mbs == 1:
            assert forward > t["gradients"]
            assert s.gpu_bytes == pytest.approx(states - t["gradients"] + forward)
        else:
            assert s.gpu_bytes == pytest.approx(states + forward)
    with_ep = make_layout(tiny_v4, small_cluster, small_train, tp=1, pp=1, ep=2, cp=1)
    t = _terms(actor_memory(tiny_v4, small_cluster, small_train, with_ep)[0])
    assert t["MoE dispatch buffers"] == 64 * 2 * 2 * 64 * 2  # t x (send + receive) x k x H x 2 B
