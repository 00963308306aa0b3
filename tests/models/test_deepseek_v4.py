"""DeepSeek-V4: lockstep's one model definition against transformers 5.23 on identical weights,
and the rollout (incremental) path against the training (full-sequence) path."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV4Config as HFConfig
from transformers import DeepseekV4ForCausalLM as HFModel

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM, Routing, StepBatch
from lockstep.models.deepseek_v4_config import CSA, HCA, SLIDING
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers.grouped_gemm import grouped_mm, grouped_mm_reference
from lockstep.models.layers.moe import router_scores

CONFIGS = {
    # every layer kind: window-only, C4 + indexer top-k, C128-style dense, hash and top-k MoE
    "mixed": tiny_config(),
    # HCA-first schedule as in V4 defaults, plain rope, larger top-k
    "hca_first": tiny_config(layer_types=(HCA, HCA, CSA, HCA), compress_rope_scaling=None, index_topk=5,
                             compress_rates={CSA: 4, HCA: 8}, sliding_window=6,
                             mlp_layer_types=("hash_moe", "hash_moe", "moe", "moe")),
    # three layers, top-3 of 8 experts, more heads and groups
    "wide": tiny_config(num_hidden_layers=3, layer_types=(SLIDING, CSA, HCA), mlp_layer_types=("hash_moe", "moe", "moe"),
                        n_routed_experts=8, num_experts_per_tok=3, num_attention_heads=8, o_groups=4, index_topk=2),
}


def make_pair(config, seed=0):
    ours = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(ours, seed)
    hf_config = HFConfig(**config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    ref = HFModel(hf_config).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing)
    return ours.eval(), ref


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    config = CONFIGS[name]
    ours, ref = make_pair(config)
    # longer than the window and spanning many compressed blocks of both kinds
    ids = torch.randint(0, config.vocab_size, (2, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff


def run_incremental(model, ids, chunk_plan, num_slots=6, slots=None):
    """Feed each row of ids through forward_step in the given chunk sizes, many rows per step."""
    B, S = ids.shape
    cache = model.new_cache(num_slots=num_slots, max_len=S + 8)
    slots = slots or list(range(B))
    pos, step, out = [0] * B, 0, [[] for _ in range(B)]
    while any(p < S for p in pos):
        rows = [i for i in range(B) if pos[i] < S]
        n = [min(chunk_plan[i][step] if step < len(chunk_plan[i]) else 1, S - pos[i]) for i in rows]
        inp = torch.zeros(len(rows), max(n), dtype=torch.long)
        for r, (i, k) in enumerate(zip(rows, n)):
            inp[r, :k] = ids[i, pos[i]:pos[i] + k]
        batch = StepBatch(slots=torch.tensor([slots[i] for i in rows]), start_pos=torch.tensor([pos[i] for i in rows]),
                          num_new=torch.tensor(n))
        logits = model.forward_step(inp, batch, cache)
        for r, (i, k) in enumerate(zip(rows, n)):
            out[i].append(logits[r, :k])
            pos[i] += k
        step += 1
    return torch.stack([torch.cat(o) for o in out]), cache


@pytest.mark.parametrize("name", list(CONFIGS))
def test_incremental_equals_full_sequence(name):
    config = CONFIGS[name]
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, 3)
    ids = torch.randint(0, config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
    # one row decodes token by token, one prefills in odd chunks, one in chunks longer than the window
    plans = [[1] * 40, [5, 1, 3, 7, 2, 1, 9, 12], [13, 11, 16]]
    inc, _ = run_incremental(model, ids, plans, slots=[5, 0, 3])
    assert (inc - full).abs().max().item() <= 1e-5


def test_reused_slot_is_clean_after_reset():
    config = CONFIGS["mixed"]
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, 4)
    a, b = (torch.randint(0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(s)) for s in (5, 6))
    _, cache = run_incremental(model, a, [[20]], num_slots=1)
    cache.reset([0])
    batch = StepBatch(slots=torch.tensor([0]), start_pos=torch.tensor([0]), num_new=torch.tensor([20]))
    reused = model.forward_step(b, batch, cache)
    assert torch.allclose(reused, model(b), atol=1e-5)


def test_resetting_every_slot_restores_a_fresh_cache():
    # reset_all (after a weight update) clears whole tensors; it must leave what a new cache holds,
    # as resetting each slot does (the compressors' gate maxima at -inf, the rest zero)
    config = CONFIGS["mixed"]
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, 4)
    a = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(5))
    _, used = run_incremental(model, a, [[7, 13], [20]], num_slots=2)
    fresh = model.new_cache(2, 28)  # run_incremental's: S + 8
    assert any(t.isneginf().any() for layer in fresh.layers for t in layer.tensors())
    touched = [t.clone() for layer in used.layers for t in layer.tensors()]
    assert any(not torch.equal(t, f) for t, f in zip(touched, (f for layer in fresh.layers for f in layer.tensors())))
    used.reset_all()
    for layer, new in zip(used.layers, fresh.layers):
        for t, f in zip(layer.tensors(), new.tensors()):
            assert torch.equal(t, f)


def test_packed_sequences_equal_padded():
    config = CONFIGS["mixed"]
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, 7)
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (17, 9, 30)]
    cu = torch.tensor([0, 17, 26, 56])
    with torch.no_grad():
        packed = model(torch.cat(seqs), cu_seqlens=cu)
        for s, (lo, hi) in zip(seqs, zip(cu[:-1], cu[1:])):
            assert torch.allclose(packed[lo:hi], model(s.unsqueeze(0))[0], atol=1e-6)
        # the head on the picked rows alone: the same rows of the full packed logits, with their
        # gradient where a forward with autograd wants one
        index = torch.tensor([40, 3, 16, 55, 17])
        assert torch.equal(model(torch.cat(seqs), cu_seqlens=cu, logit_index=index), packed[index])
    picked = model(torch.cat(seqs), cu_seqlens=cu, logit_index=index)
    picked.sum().backward()
    assert model.lm_head.weight.grad is not None and model.model.embed_tokens.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        model(seqs[0].unsqueeze(0), logit_index=index)


def test_routing_replay_reproduces_and_forces_experts():
    config = CONFIGS["mixed"]
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, 9)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        record = Routing()
        base = model(ids, routing=record)
        chosen = record.stacked()  # [B, S, layers, k]
        assert chosen.shape == (2, 24, config.num_hidden_layers, config.num_experts_per_tok)
        replay = model(ids, routing=Routing(forced=chosen))
        assert torch.equal(replay, base)
        flipped = (chosen + 1) % config.n_routed_experts
        assert not torch.allclose(model(ids, routing=Routing(forced=flipped)), base, atol=1e-4)


def test_training_path_has_gradients_everywhere():
    config = CONFIGS["mixed"]
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, 11)
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(12))
    logp = torch.log_softmax(model(ids)[:, :-1], -1).gather(-1, ids[:, 1:, None])
    logp.mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # the last layer's C4 indexer only selects (no gradient through top-k); everything else learns
    assert all("indexer" in n for n in no_grad), no_grad


def test_grouped_mm_native_matches_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 16, generator=g), torch.randn(5, 8, 16, generator=g)
    counts = torch.tensor([3, 0, 6, 4, 0])
    with torch.no_grad():
        assert torch.allclose(grouped_mm(x, w, counts), grouped_mm_reference(x, w, counts), atol=1e-6)


def test_rope_frequencies_follow_the_device_not_the_dtype():
    # moved by model.to with the parameters (a lazy move inside a compiled layer was traced and
    # doubled the compiled graphs), and never cast: bf16 frequencies shifted logprobs by ~0.06
    model = DeepseekV4ForCausalLM(tiny_config())
    before = [layer.self_attn.inv_freq.clone() for layer in model.model.layers]
    model.to(torch.bfloat16)
    for layer, freq in zip(model.model.layers, before):
        assert layer.self_attn._inv_freq.dtype == torch.float32 and torch.equal(layer.self_attn._inv_freq, freq)
    model.to("meta")
    assert all(layer.self_attn._inv_freq.device.type == "meta" for layer in model.model.layers)


def _router_inputs_and_logits(model, ids):
    """Each MoE layer's input x [T, H] and the logits its router routed on, from one forward."""
    from lockstep.models.layers.moe import MoE, Router

    seen, logits = [], []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
             for m in model.modules() if isinstance(m, MoE)]
    route = Router.route

    def recording(self, lg, *args, **kwargs):
        logits.append(lg)
        return route(self, lg, *args, **kwargs)

    Router.route = recording
    try:
        with torch.no_grad():
            model(ids)
    finally:
        Router.route = route
        for h in hooks:
            h.remove()
    return seen, logits


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_router_logits_are_fp32_products(fused):
    # as DeepSeek's inference code: F.linear(x.float(), W.float()), also out of the engine's fused
    # projections (bf16 logits rounded near-ties differently in engine and trainer GEMM shapes)
    config = CONFIGS["mixed"]
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, 13)
    model.to(torch.bfloat16).eval()
    if fused:
        model.fuse_projections()
    ids = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(14))
    xs, logits = _router_inputs_and_logits(model, ids)
    assert len(logits) == config.num_hidden_layers  # hash and top-k layers alike
    for layer, x, lg in zip(model.model.layers, xs, logits):
        assert lg.dtype == torch.float32
        assert torch.equal(lg, F.linear(x.float(), layer.mlp.gate.weight.float()))


def test_bf16_routing_matches_transformers_up_to_its_bf16_logits():
    # transformers 5.23 computes router logits in the weight dtype; lockstep in fp32 (above). On
    # transformers' own router inputs, lockstep's logits round to transformers' and the experts
    # agree wherever transformers' k-th and (k+1)-th scores are further apart than bf16 rounding
    config = CONFIGS["wide"]
    ours, ref = make_pair(config, seed=15)
    ours.to(torch.bfloat16), ref.to(torch.bfloat16)
    captured = []
    hooks = [m.register_forward_hook(lambda m, args, out: captured.append((args, out)))
             for name, m in ref.named_modules() if name.endswith("mlp.gate")]
    ids = torch.randint(0, config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        ref(ids)
    for h in hooks:
        h.remove()
    assert len(captured) == config.num_hidden_layers
    k = config.num_experts_per_tok
    for layer, (args, (hf_logits, hf_weights, hf_experts)) in zip(ours.model.layers, captured):
        router = layer.mlp.gate
        x = args[0].reshape(-1, config.hidden_size)
        logits = router.logits(x)
        assert torch.allclose(logits.to(torch.bfloat16).float(), hf_logits.float(), rtol=2**-7, atol=1e-6)
        experts, weights = router.route(logits, ids.reshape(-1))
        order = hf_experts.argsort(dim=-1)  # ours ascending by expert id
        hf_experts, hf_weights = hf_experts.gather(1, order), hf_weights.float().gather(1, order)
        differ = (experts != hf_experts).any(-1)
        if router.is_hash:
            assert not differ.any()
        else:
            biased = router_scores(hf_logits, router.scoring_func) + router.e_score_correction_bias.float()
            top = biased.topk(k + 1, dim=-1).values
            assert (top[differ, k - 1] - top[differ, k] < 2e-2).all()  # only near-ties flip
        assert torch.allclose(weights[~differ], hf_weights[~differ], rtol=2e-2, atol=1e-3)
