"""The decode step without device syncs, and the CUDA-graph decode path.

The graph runner's eager stand-in (capture=False) runs the captured forward's exact ops: static
shapes, padding to a bucket with scratch-slot rows, compressed attention over the whole cache
capacity; it is compared with the engine's plain decode. With LOCKSTEP_TEST_DEVICE=cuda, real
captured graphs are also compared with the stand-in (bf16: the dtype graphs are captured in)."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from lockstep.config import SamplingParams
from lockstep.engine import GenerateRequest, runner
from lockstep.engine.cuda_graph import bucket_sizes
from lockstep.engine.sync_audit import SyncAudit
from lockstep.models.layers import moe

from conftest import (DEVICE, FEW_SINKHORN, full_sequence_log_softmax, greedy, make_engine, prompts, requests,
                      same_outputs, sampled, start_decoding, tiny_dsv4)


def params_for(i):
    # different lengths: the batch shrinks through several buckets as sequences finish
    if i % 3 == 0:
        return greedy(max_new_tokens=6 + 3 * i)
    return sampled(seed=40 + i, max_new_tokens=6 + 3 * i, top_p=0.9 if i % 2 else 1.0, return_routed_experts=True)


def graph_engine(seed, capture=False, compile_backend="auto", **kw):
    """An engine whose decode steps go through the graph runner (captured, or its eager stand-in)."""
    engine = make_engine(seed=seed, cuda_graph=False, **kw)
    engine.adapter.enable_graphs(engine.config.max_num_seqs, capture=capture, compile_backend=compile_backend)
    return engine


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(2) == [2]
    assert bucket_sizes(16) == [2, 4, 8, 16]
    assert bucket_sizes(48) == [2, 4, 8, 16, 32, 48]


def test_graph_decode_equals_eager_decode():
    # 7 sequences (bucket 8, one padding row), prompts past the window (8) and many C4 blocks;
    # max_model_len 96: the fixed-capacity attention masks most of the compressed entries
    ps = prompts(7, lo=3, hi=50, seed=21)
    eager = make_engine(seed=22, cuda_graph=False).generate(requests(ps, params_for))
    graphed = graph_engine(22).generate(requests(ps, params_for))
    same_outputs(graphed, eager, atol=1e-5 if DEVICE == "cpu" else 2e-2)
    for a, b in zip(graphed, eager):
        if b.routed_experts is not None:
            assert torch.equal(a.routed_experts, b.routed_experts)


def test_graph_decode_with_siblings_and_a_full_batch():
    # n = 4 samples fork from one prefill; 16 sequences fill the largest bucket exactly
    reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, seed=3 + i, n=4, max_new_tokens=9))
            for i, p in enumerate(prompts(4, lo=5, hi=30, seed=23))]
    eager = make_engine(seed=24, cuda_graph=False).generate(reqs)
    reqs = [GenerateRequest(r.prompt_ids, r.sampling) for r in reqs]
    same_outputs(graph_engine(24).generate(reqs), eager, atol=1e-5 if DEVICE == "cpu" else 2e-2)


def test_graphs_survive_weight_updates_and_flush():
    # weights are written in place: the same graphs decode with the new weights
    engine, ref = graph_engine(25), make_engine(seed=25, cuda_graph=False)
    new = tiny_dsv4(26).state_dict()
    ps = prompts(3, lo=5, hi=20, seed=27)
    for e in (engine, ref):
        e.generate(requests(ps, greedy(max_new_tokens=5)))
        e.update_weights(new.items(), version=1)
        assert e.flush_cache()
    graphs = engine.adapter.graphs
    same_outputs(engine.generate(requests(ps, greedy(max_new_tokens=8))),
                 ref.generate(requests(ps, greedy(max_new_tokens=8))), atol=1e-5 if DEVICE == "cpu" else 2e-2)
    assert engine.adapter.graphs is graphs


@pytest.mark.parametrize("graphs", [False, True])
def test_a_decode_step_syncs_once(graphs):
    # the forward reads nothing back; the sampler reads every token and logprob in one copy
    # (single steps here; test_multi_step.py checks windows of several)
    # (on CUDA in bf16: torch._grouped_mm's dtype; other dtypes take a loop that reads group sizes)
    kw = dict(dtype="bfloat16") if DEVICE == "cuda" else {}
    engine = graph_engine(28, decode_steps=1, **kw) if graphs else make_engine(seed=28, cuda_graph=False, **kw)
    ps = prompts(5, lo=10, hi=40, seed=29)
    params = [greedy(max_new_tokens=20), sampled(seed=1, max_new_tokens=20, top_k=5, return_routed_experts=True)]
    start_decoding(engine, requests(ps, lambda i: params[i % 2]))
    with SyncAudit() as audit:
        for _ in range(4):
            engine.step()
    assert audit.counts["sync_ops"] == 0 and audit.counts["h2d_blocking"] == 0
    assert audit.counts["value_reads"] == 4, audit.counts


def test_compiled_layers_trace_twice_per_layer_kind(monkeypatch):
    # the regional compile: per (attention kind, router kind) one graph for decode (one new token
    # per row) shared by every bucket, and one for prefill shared by every prompt length and batch;
    # the same two for the model's final head
    # (a single prompt gets a padding row: a batch of one would be specialised). Counted behind
    # AOT autograd, inductor's front end: its decompositions add guards of their own (a chunk of
    # 2..m tokens, m an overlapping compressor's rate, was one more graph; a float attribute
    # restarted each kind's first trace), and it runs the traced ops, so the outputs are the
    # stand-in's. A counting backend: on CUDA mHC's coefficients outside the region compile too.
    ps = prompts(7, lo=3, hi=50, seed=32)
    # the MoE dispatch's size limit between the warm-up's chunk (120 one-hot entries) and the
    # prompts' (up to 384): a compiled prefill deciding by size would compile again (it did on the
    # 1b config, whose 4,096-token prefill crossed the real limit)
    monkeypatch.setattr(moe, "COUNTING_MAX_ENTRIES", 150)
    torch._dynamo.reset()
    traced = []
    aot_eager = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward))

    def counting_aot_eager(gm, example_inputs):
        traced.append(gm)
        return aot_eager(gm, example_inputs)

    # tracing costs per op (symbolic shapes), not per element: 2 Sinkhorn iterations (a column, a row,
    # a column step) instead of 20 trace the same ops, about a third fewer of them in each graph
    engine = graph_engine(33, model=tiny_dsv4(33, **FEW_SINKHORN), compile_backend=counting_aot_eager,
                          dtype="bfloat16")
    layers = engine.model.model.layers
    kinds = {(type(layer.self_attn.compressor), layer.mlp.gate.is_hash) for layer in layers}
    assert len(kinds) < len(layers)  # the tiny config repeats a kind, so sharing is tested
    engine.adapter.warm_up_prefill()  # the engine's start on CUDA: the prefill graphs, + the final head's
    assert len(traced) == len(kinds) + 1
    out = engine.generate(requests(ps, params_for))
    assert len(traced) == 2 * len(kinds) + 2  # the decode graphs now; the prefills used the warm-up's
    # one prompt: its short chunks padded to two rows, its long ones eager; no new graph
    monkeypatch.setattr(runner, "PAD_ONE_ROW_MAX_TOKENS", 16)
    long_prompt = prompts(1, lo=34, hi=35, seed=35)
    single = engine.generate(requests(long_prompt, params_for))  # chunks of 32 (eager) and 2 (3 x 2 padded)
    assert len(traced) == 2 * len(kinds) + 2
    stand_in_engine = graph_engine(33, model=tiny_dsv4(33, **FEW_SINKHORN), compile_backend=None, dtype="bfloat16")
    stand_in = stand_in_engine.generate(requests(ps, params_for))
    # bitwise on the CPU; on CUDA the region and eager take different kernels for the same sums
    # (hyper_connection.hc_combine's element-wise form compiled, a Triton kernel or cuBLAS eager)
    same_outputs(out, stand_in, exact=DEVICE == "cpu", atol=2e-2)
    same_outputs(single, stand_in_engine.generate(requests(long_prompt, params_for)), exact=DEVICE == "cpu", atol=2e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU (LOCKSTEP_TEST_DEVICE=cuda)")
def test_captured_graphs_replay_exactly_the_stand_in():
    ps = prompts(7, lo=3, hi=50, seed=30)
    captured = graph_engine(31, capture=True, compile_backend=None, dtype="bfloat16")
    assert captured.adapter.graphs.capture and captured.adapter.graphs.graphs
    out = captured.generate(requests(ps, params_for))
    stand_in = graph_engine(31, capture=False, dtype="bfloat16").generate(requests(ps, params_for))
    same_outputs(out, stand_in, atol=1e-3)  # the same kernels: equal unless capture mishandles a buffer


@pytest.mark.skipif(DEVICE != "cuda", reason="inductor's Triton kernels need a GPU (LOCKSTEP_TEST_DEVICE=cuda)")
def test_compiled_graphs_score_their_tokens_as_the_full_forward_does():
    # inductor keeps fused bf16 chains in fp32 registers: close to the eager ops, not bitwise, so a
    # near-tie can flip a token against the eager stand-in (a greedy one did, on an H200). What the
    # trainer needs holds token by token: each token's logprob is the full forward's (the trainer's
    # view), and each greedy token is the full forward's argmax up to that closeness.
    ps = prompts(7, lo=3, hi=50, seed=34)
    compiled = graph_engine(35, capture=True, dtype="bfloat16")
    assert compiled.adapter.graphs.compiled_layers is not None
    worst = 0.0
    for i, s in enumerate(compiled.generate(requests(ps, params_for))):
        temperature = params_for(i).temperature
        lp = full_sequence_log_softmax(compiled.model, s, temperature)
        chosen = lp.gather(1, s.response_ids.unsqueeze(1)).squeeze(1)
        worst = max(worst, (s.rollout_logprobs - chosen).abs().max().item())
        if temperature == 0:
            assert (lp.max(dim=1).values - chosen).max().item() <= 2e-2
    print(f"max |compiled engine - full forward| logprob: {worst:.2e}")
    assert worst <= 2e-2


def test_compiled_layer_honours_forced_experts():
    # routing replay through the compiled region: the layer's own slice of the forced experts
    from lockstep.models.compiled_layers import CompiledLayers
    from lockstep.models.deepseek_v4 import Routing

    model = tiny_dsv4(36)
    c = model.config
    streams = torch.randn(3, 10, c.hc_mult, c.hidden_size)
    ids = torch.randint(0, c.vocab_size, (3, 10))
    forced = torch.stack([torch.randperm(c.n_routed_experts)[:c.num_experts_per_tok]
                          for _ in range(3 * 10 * c.num_hidden_layers)]).view(3, 10, c.num_hidden_layers, -1)
    compiled = CompiledLayers("eager")
    with torch.no_grad():
        for layer in model.model.layers[:2]:
            ours, ref = Routing(forced=forced), Routing(forced=forced)
            out = compiled(layer, streams, ids, ours, layer.self_attn.forward_full)
            expected = layer(streams, ids, ref, layer.self_attn.forward_full)
            # fp32 under compile takes the gathered grouped GEMM: equal up to summation order
            assert torch.allclose(out, expected, rtol=0, atol=1e-5)
            assert torch.equal(ours.chosen[0], forced[..., layer.layer_idx, :].sort(dim=-1).values)


def test_compile_options_reach_the_compiled_layers_and_bad_ones_name_the_field():
    from lockstep.models.compiled_layers import CompiledLayers

    with pytest.raises(ValueError, match="EngineConfig.compile_options: 'combo_kernel' is not an inductor setting"):
        make_engine(compile_options={"combo_kernel": True})
    with pytest.raises(ValueError, match="'combo_kernels' takes a bool"):
        make_engine(compile_options={"combo_kernels": "yes"})
    with pytest.raises(ValueError, match="need the inductor backend"):
        CompiledLayers("eager", {"combo_kernels": True})
    # inductor compiles lazily: building the graphs' compiled layers compiles nothing yet
    engine = graph_engine(37)
    engine.adapter.enable_graphs(4, capture=False, compile_backend="inductor",
                                 compile_options={"coordinate_descent_tuning": True})
    # the decode step's own defaults under those configured (cuda_graph.DECODE_INDUCTOR_OPTIONS)
    assert engine.adapter.graphs.compiled_layers.options == {"combo_kernels": True, "coordinate_descent_tuning": True}
    engine.adapter.enable_graphs(4, capture=False, compile_backend="inductor", compile_options={"combo_kernels": False})
    assert engine.adapter.graphs.compiled_layers.options == {"combo_kernels": False}
    engine.adapter.enable_graphs(4, capture=False, compile_backend="eager", compile_options={"combo_kernels": True})
    assert engine.adapter.graphs.compiled_layers.options == {}  # settings of inductor's only


def test_batch_invariant_graph_decode_keeps_each_calls_logits():
    # batch-invariant mode runs every decoding sequence in a call of its own, all in one step: each
    # call's logits are a view of the graphs' shared output (the stand-in's too), so the runner must
    # keep a copy before the next call (this was the GPU batch-invariant gap: 2.1e-3 vs 2.1e-5)
    ps = prompts(5, lo=3, hi=30, seed=41)
    eager = make_engine(seed=42, cuda_graph=False, batch_invariant=True).generate(requests(ps, params_for))
    graphed = graph_engine(42, batch_invariant=True).generate(requests(ps, params_for))
    same_outputs(graphed, eager, atol=1e-5 if DEVICE == "cpu" else 2e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU (LOCKSTEP_TEST_DEVICE=cuda)")
def test_captured_graphs_batch_invariant_equal_the_stand_in():
    # the GPU side of test_batch_invariant_graph_decode_keeps_each_calls_logits: several replays per
    # step, each call's logits kept (before the fix the captured engine sampled other rows' logits)
    ps = prompts(5, lo=3, hi=30, seed=41)
    captured = graph_engine(42, capture=True, compile_backend=None, dtype="bfloat16", batch_invariant=True)
    stand_in = graph_engine(42, capture=False, dtype="bfloat16", batch_invariant=True)
    same_outputs(captured.generate(requests(ps, params_for)), stand_in.generate(requests(ps, params_for)), atol=1e-3)
