"""The true-on-policy forward (models/deepseek_v4_rows.py): a token's logits have the same bits
in a training forward, in prefill chunks of any size, in decode steps of any batch, alone or among
other sequences, in fp32 and in bf16 (every layer kind: window, C4 + indexer, C128, hash / top-k MoE)."""

import contextlib
import os

import pytest
import torch
from test_deepseek_v4 import CONFIGS, run_incremental

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM, Routing
from lockstep.models.deepseek_v4_config import CSA, HCA, SLIDING
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers import grouped_gemm_triton, row_blocks as row_blocks_module
from lockstep.models.layers.kernel_switch import KernelSwitches, set_kernel_switches
from lockstep.models.layers.attention_rows import FullSequences
from lockstep.models.layers.key_tiles import ENTRY_TILE
from lockstep.models.layers.row_blocks import ROWS, row_blocks
from lockstep.models.precision import cast_model

ON = KernelSwitches(true_on_policy=True)
# every layer kind once, for the tests whose interpreted kernels cost per layer ("mixed" repeats a C4 layer)
EVERY_KIND_ONCE = tiny_config(num_hidden_layers=3, layer_types=(SLIDING, CSA, HCA),
                              mlp_layer_types=("hash_moe", "moe", "moe"))
# the Triton kernels on CPU tensors: the interpreter, set by tests/conftest.py except on GPU runs
interpreted_triton = pytest.mark.skipif(grouped_gemm_triton.triton is None or not grouped_gemm_triton.interpreted(),
                                        reason="needs triton with TRITON_INTERPRET=1 (every CPU run sets it)")


def true_on_policy_model(name, dtype: torch.dtype, seed: int = 3) -> DeepseekV4ForCausalLM:
    """name: a CONFIGS key, or a config."""
    model = DeepseekV4ForCausalLM(CONFIGS[name] if isinstance(name, str) else name)
    init_deepseek_v4_(model, seed)
    cast_model(model, dtype)
    return set_kernel_switches(model, ON)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_rollout_steps_equal_the_training_forward_bitwise(name, dtype):
    model = true_on_policy_model(name, dtype)
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        alone = model(ids[1:2])
        # token by token; odd prefill chunks; chunks longer than the window (rows join and leave)
        steps, _ = run_incremental(model, ids, [[1] * 40, [5, 1, 3, 7, 2, 1, 9, 12], [13, 11, 16]], slots=[5, 0, 3])
    assert torch.equal(steps, full)
    assert torch.equal(alone, full[1:2])  # batch composition and padding length
    set_kernel_switches(model, KernelSwitches())
    with torch.no_grad():
        default = model(ids)
    # the same function as the default forward, up to rounding
    assert (default - full).abs().max().item() <= (1e-4 if dtype == torch.float32 else 2e-2)


def test_training_forward_has_gradients_and_routing():
    model = true_on_policy_model("mixed", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    routing = Routing()
    model(ids, routing=routing).logsumexp(-1).mean().backward()
    assert routing.stacked().shape == (2, 30, model.config.num_hidden_layers, model.config.num_experts_per_tok)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    # hash-routed layers never read their router weight, the indexer only selects (top-k has no
    # gradient), as in the default forward
    assert all("gate.weight" in n or "indexer" in n for n in missing), missing
    replay = Routing(forced=routing.stacked())
    with torch.no_grad():
        assert torch.equal(model(ids, routing=replay), model(ids))


@pytest.mark.parametrize("grad", [True, False])  # concatenated with autograd, streamed into one output without
def test_row_blocks_pad_and_concatenate(grad):
    x = torch.arange(ROWS * 2 + 3, dtype=torch.float32).unsqueeze(1)
    seen = []
    with torch.set_grad_enabled(grad):
        out, none = row_blocks(lambda a, b: (seen.append(a.shape[0]) or a * 2, b), x, None)
        assert torch.equal(out, x * 2) and none is None and seen == [ROWS] * 3
        assert row_blocks(lambda a: a + 1, x[:0]).shape == (0, 1)


@pytest.mark.skipif(not os.environ.get("LOCKSTEP_TEST_DEVICE", "cpu").startswith("cuda"),
                    reason="CUDA graphs: LOCKSTEP_TEST_DEVICE=cuda (CPU runs test the eager loop, the reference)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_block_graphs_equal_the_eager_loop(monkeypatch, dtype):
    model = true_on_policy_model("mixed", dtype).cuda()
    set_kernel_switches(model, KernelSwitches(true_on_policy=True, fixed_order=False))  # row blocks, not whole rows
    ids = torch.randint(0, model.config.vocab_size, (2, 4 * ROWS + 9), generator=torch.Generator().manual_seed(6))
    captured = []
    capture = row_blocks_module._capture
    monkeypatch.setattr(row_blocks_module, "_capture", lambda *a: captured.append(1) or capture(*a))
    with torch.no_grad():
        graphs = model(ids.cuda())
        monkeypatch.setenv("LOCKSTEP_ROW_GRAPHS", "0")
        eager = model(ids.cuda())
    assert captured and torch.equal(graphs, eager)


def test_long_sequences_span_several_entry_tiles():
    # C4 entries past one tile: sequence of 4 * ENTRY_TILE + 9 tokens
    model = true_on_policy_model("mixed", torch.float32)
    S = 4 * ENTRY_TILE + 9
    ids = torch.randint(0, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids)
        steps, _ = run_incremental(model, ids, [[S - 40] + [1] * 40], num_slots=2)
    assert torch.equal(steps, full)


def test_causal_entry_groups_skip_only_masked_tiles(monkeypatch):
    # rows grouped by position, each group walking the entry tiles its last position can see: the same
    # bits as walking every tile
    model = true_on_policy_model("mixed", torch.float32)
    S = 3 * ENTRY_TILE * 4 + 5  # rate-4 entries (this config's HCA layers) span 3 tiles and a bit
    ids = torch.randint(0, model.config.vocab_size, (2, S), generator=torch.Generator().manual_seed(7))
    keys = FullSequences(2, S, "cpu")
    groups = keys.reach_groups(4)
    rows = torch.cat([index for index, _ in groups])
    assert torch.equal(rows.sort().values, torch.arange(2 * S))  # every row once
    assert [reach for _, reach in groups] == [ENTRY_TILE, 2 * ENTRY_TILE, 3 * ENTRY_TILE, 4 * ENTRY_TILE]
    for index, reach in groups:  # no row sees past its group's reach
        assert ((keys.positions[index] + 1) // 4).max() <= reach
    with torch.no_grad():
        grouped = model(ids)
        monkeypatch.setattr(FullSequences, "reach_groups", lambda self, m: [(None, None)])
        every_tile = model(ids)
    assert torch.equal(grouped, every_tile)


@interpreted_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_order_whole_rows_keep_steps_equal_to_training(monkeypatch, dtype):
    """KernelSwitches.fixed_order: a layer's mHC and norm steps, its attention (projections, C4 entry
    picks, compressors' pooling, core, output), the head and, in bf16 where the routed experts take the
    Triton kernels, its MoE over all rows at once through the fixed-order kernels (here interpreted):
    steps still equal the training forward bitwise, and the logits are the row-block forward's up to
    summation order."""
    from lockstep.models.layers import (fixed_order_linear, index_scores_triton, moe, norm, pool_slots_triton,
                                        tiled_attention_triton)

    model = true_on_policy_model(EVERY_KIND_ONCE, dtype)
    # 12 tokens: past the window (8) and 3 rate-4 entries; the interpreted kernels cost per row and
    # per call, so few rows: 2 x 16 tokens took 61 s (bf16) on 2 CPU cores
    S = 12
    ids = torch.randint(0, model.config.vocab_size, (2, S), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        blocks = model(ids)
    set_kernel_switches(model, KernelSwitches(true_on_policy=True, fixed_order=True))
    norms, attention, gemms, moes, scores, pools = [], [], [], [], [], []

    def spy(module, name, log, rows):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a: log.append(rows(*a)) or kernel(*a))

    spy(norm, "fixed_order_rms_norm", norms, lambda x, *_: x.shape[0])
    spy(tiled_attention_triton, "tiled_sink_attention", attention, lambda q, *a: (q.shape[0], a[3] is not None))
    spy(fixed_order_linear, "fixed_order_linear", gemms,
        lambda x, w, fp32_out=False: (x.shape[0], x.dtype, fp32_out))
    spy(moe.MoE, "_route_and_compute", moes, lambda self, x, *_: x.shape[0])
    spy(index_scores_triton, "index_scores", scores, lambda q, *_: q.shape[0])
    spy(pool_slots_triton, "pool_slots", pools, lambda kv, gate: kv.shape[0])
    # the experts' Triton kernels under the interpreter (on CUDA only otherwise)
    monkeypatch.setattr(moe, "_row_invariant_kernels", lambda x, gate_up, down: grouped_gemm_triton.available(x, gate_up))
    with torch.no_grad():
        full = model(ids)
        # prefill chunks beside a whole-prompt prefill, then a decode step and chunks past the window
        steps, _ = run_incremental(model, ids, [[5, 1, 6], [S]], slots=[5, 0])
    assert torch.equal(steps, full)
    assert 2 * S in norms  # the training forward's norms took all 24 rows in one call
    assert (2 * S, True) in attention and (2 * S, False) in attention  # cores with and without entries
    assert (2 * S, dtype, False) in gemms and (2 * S, torch.float32, False) in gemms  # projections; the router
    assert (2 * S, dtype, True) in gemms  # the head: fp32 logits
    assert (2 * S in moes) == (dtype == torch.bfloat16)  # whole rows where the experts' kernels run
    assert 2 * S in scores and 2 * (S // 4) in pools  # every row's C4 picks, every rate-4 entry: one call each
    assert (full - blocks).abs().max().item() <= (1e-4 if dtype == torch.float32 else 5e-2)


@interpreted_triton
def test_compiled_whole_rows_trace_in_whole_rows_mode_and_keep_steps_equal_to_training(monkeypatch):
    """KernelSwitches.compile_rows: the whole-rows steps through torch.compile (dynamo's trace with the
    eager backend on the CPU; inductor on CUDA): the modules inside take their whole-rows forms (the
    logits equal the uncompiled whole-rows forward's bitwise), every step kind went through its
    compiled form (the MoE's routing and experts too: bf16, the grouped kernels interpreted), and
    engine steps still equal the training forward bitwise."""
    from lockstep.models.layers import compiled_rows, moe

    monkeypatch.setattr(moe, "_row_invariant_kernels", lambda x, gate_up, down: grouped_gemm_triton.available(x, gate_up))
    model = true_on_policy_model(EVERY_KIND_ONCE, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    set_kernel_switches(model, KernelSwitches(true_on_policy=True, fixed_order=True))
    with torch.no_grad():
        eager = model(ids)
    set_kernel_switches(model, KernelSwitches(true_on_policy=True, fixed_order=True, compile_rows=True))
    calls, symbolic = [], []

    def recording(gm, example_inputs):  # dynamo's eager backend, noting which input dims are symbols
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                symbolic.append([isinstance(d, torch.SymInt) for d in value.shape])
        return gm.forward

    monkeypatch.setattr(compiled_rows, "_compiled", {})
    monkeypatch.setattr(compiled_rows, "backend", lambda on_cuda: recording)
    call = compiled_rows.call
    monkeypatch.setattr(compiled_rows, "call", lambda fn, *a: calls.append(fn.__name__) or call(fn, *a))
    torch._dynamo.reset()
    with torch.no_grad():
        full = model(ids)
        steps, _ = run_incremental(model, ids, [[11, 1], [12]], slots=[5, 0])
    assert torch.equal(full, eager)
    assert torch.equal(steps, full)
    assert set(calls) == {"_before_attention", "_projections", "_output", "_before_moe", "_route_and_compute",
                          "_pool_and_finish", "hc_combine", "final_hidden", "_head_logits", "window_keys",
                          "write_window", "_step_blocks", "_write_state"}  # the last 4: decode only
    # only the row dim is a symbol (mark_rows_dynamic: a symbolic hidden dim costs Triton its vector loads)
    assert any(dims and dims[0] for dims in symbolic) and not any(any(dims[1:]) for dims in symbolic)


@interpreted_triton
def test_triton_grouped_experts_keep_rows_independent(monkeypatch):
    """On CUDA in bf16 the routed experts run the Triton grouped kernels (their launch config depends
    on N and K only); here under the interpreter: steps still equal the training forward bitwise, and
    a training forward still gives the experts a gradient (the default forward's, ExactValues)."""
    from lockstep.models.layers import moe

    calls = []

    def kernels_on_cpu(x, gate_up, down):
        calls.append(x.shape[0])
        return grouped_gemm_triton.available(x, gate_up)

    monkeypatch.setattr(moe, "_row_invariant_kernels", kernels_on_cpu)
    model = true_on_policy_model("mixed", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids)
        # prefill chunks, then decode steps beside the other row: 4 steps (each pads to a 64-row block,
        # an interpreted kernel call of its own)
        steps, _ = run_incremental(model, ids, [[10, 1, 3], [4, 6, 1, 3]])
    assert calls and torch.equal(steps, full)
    model(ids).float().logsumexp(-1).mean().backward()
    assert model.model.layers[1].mlp.experts.gate_up_proj.grad.abs().sum() > 0


@interpreted_triton
def test_kernel_experts_backward_is_the_default_paths(monkeypatch):
    """A gradient through the true-on-policy forward's Triton experts recomputes and differentiates
    the default grouped path: the default path's gradients (up to the loss's own gradient, which
    reads forward values 1 bf16 ulp apart)."""
    from lockstep.models.layers import moe
    from lockstep.models.layers.row_blocks import rows_forward

    monkeypatch.setattr(moe, "_row_invariant_kernels", lambda x, gate_up, down: True)
    experts = true_on_policy_model("mixed", torch.bfloat16).model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(8)
    x = torch.randn(12, experts.gate_up_proj.shape[-1], generator=g).bfloat16().requires_grad_()
    chosen = torch.rand(12, experts.n_experts, generator=g).argsort(-1)[:, :2].sort(-1).values
    weights = torch.rand(12, 2, generator=g)
    grads = []
    for rows in (True, False):
        with rows_forward() if rows else contextlib.nullcontext():
            experts(x, chosen, weights).float().square().sum().backward()
        grads.append([t.grad.clone() for t in (x, experts.gate_up_proj, experts.down_proj)])
        for t in (x, experts.gate_up_proj, experts.down_proj):
            t.grad = None
    for kernel_grad, default_grad in zip(*grads):
        torch.testing.assert_close(kernel_grad, default_grad, rtol=2e-2, atol=1e-2)
