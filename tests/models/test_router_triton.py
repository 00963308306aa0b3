"""A decode step's top-k router as one Triton kernel (router_triton.py) against moe.Router's torch
ops. The kernel runs under Triton's interpreter here (TRITON_INTERPRET=1, set in conftest.py);
LOCKSTEP_TEST_DEVICE=cuda runs the same tests on a GPU."""

import os

import pytest
import torch

from lockstep.models.layers import moe, router_triton as rt
from lockstep.models.layers.kernel_switch import KernelSwitches

needs_triton = pytest.mark.skipif(rt.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"


def _router(E, H, k, scoring, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    router = moe.Router(H, E, k, vocab_size=8, is_hash=False, scoring_func=scoring, routed_scaling_factor=1.5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) * spread * H ** -0.5)
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    return router.to(DEVICE)


def _x(T, H, dtype, seed):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _kernel(router, x, block_t=0, split=-1):
    return rt.route_step(x, router.weight, router.e_score_correction_bias, router.top_k, router.scoring_func,
                         router.routed_scaling_factor, block_t=block_t, split=split)


def _margins(router, x):
    """Per token, the gap between the k-th and (k + 1)-th biased score: where it is below fp32
    rounding the two paths may choose differently."""
    scores = moe.router_scores(router.logits(x), router.scoring_func) + router.e_score_correction_bias
    top = scores.topk(router.top_k + 1, dim=-1).values
    return top[:, -2] - top[:, -1]


@needs_triton
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# the 1b config's router (64 experts of 1024, k = 6); fewer tokens than a program's rows, E and H
# not powers of two (padding), logits large enough to take softplus's linear branch
@pytest.mark.parametrize("T,E,H,k,spread", [(20, 64, 1024, 6, 1.0), (5, 40, 200, 3, 30.0)])
# the one kernel at one token a program (broadcast products) and at the default 16 (tl.dot in
# tf32x3 on a GPU; rows past T masked), and the logits as 4 split-K partial sums (a first kernel,
# hc_projection_triton's) routed 2 tokens a program, or the default SPLIT's routed PARTIALS_BLOCK_T a program
@pytest.mark.parametrize("form", [dict(block_t=1, split=0), dict(split=0), dict(split=4, block_t=2), dict()],
                         ids=["t1", "t16", "split4-t2", "default"])
def test_the_kernel_equals_the_routers_torch_ops(scoring, dtype, T, E, H, k, spread, form):
    router, x = _router(E, H, k, scoring, T + E, spread), _x(T, H, dtype, H)
    with torch.no_grad():
        experts, weights = _kernel(router, x, **form)
        ref_experts, ref_weights = router.route(router.logits(x), None)
        margins = _margins(router, x)
    assert experts.dtype == torch.long and weights.dtype == torch.float32 and experts.shape == (T, k)
    clear = margins > 1e-5  # rows whose choice fp32 rounding cannot flip
    assert clear.sum() >= T - 1
    assert torch.equal(experts[clear], ref_experts[clear])
    assert (experts.diff(dim=-1) > 0).all()  # ascending, no repeats
    torch.testing.assert_close(weights[clear], ref_weights[clear], rtol=1e-5, atol=1e-6)


@needs_triton
def test_equal_scores_go_to_the_lower_expert():
    # every expert's weight row the same: all scores tie, the k lowest indices win
    router = _router(16, 64, 4, "sqrtsoftplus", 1)
    with torch.no_grad():
        router.weight.copy_(router.weight[:1].expand(16, 64))
        router.e_score_correction_bias.zero_()
        experts, weights = _kernel(router, _x(3, 64, torch.float32, 2))
    assert experts.tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(weights, torch.full((3, 4), 1.5 / 4, device=weights.device))


@needs_triton
def test_a_nan_row_still_gets_k_distinct_experts():
    # the experts index the dispatch: a broken row must not leave a slot unwritten or out of range
    router, x = _router(16, 64, 4, "sqrtsoftplus", 7), _x(2, 64, torch.float32, 8)
    x[1, 3] = float("nan")
    with torch.no_grad():
        experts, weights = _kernel(router, x)
        ref, _ = router.route(router.logits(x[:1]), None)
    assert experts[1].tolist() == [0, 1, 2, 3] and torch.isnan(weights[1]).all()
    assert torch.equal(experts[:1], ref)


def test_the_router_takes_the_kernel_only_at_a_decode_step_on_cuda(monkeypatch):
    router = _router(16, 64, 4, "sqrtsoftplus", 3).cpu()
    router.kernels = KernelSwitches(triton_router=True)
    seen = []
    monkeypatch.setattr(rt, "route_step", lambda *a: seen.append(a) or (None, None))
    x = _x(2, 64, torch.float32, 4).cpu()
    with torch.no_grad():
        router(x, None, decode=True)  # CPU: torch ops
    assert seen == []
    if torch.cuda.is_available():
        router.cuda()
        x = x.cuda()
        with torch.no_grad():
            router(x, None, decode=True)
            assert len(seen) == 1
            router(x, None)  # prefill: torch ops
            router(x, None, forced=torch.zeros(2, 4, dtype=torch.long, device="cuda"), decode=True)  # replayed
            router.kernels = KernelSwitches(triton_router=False)  # switched off
            router(x, None, decode=True)
        router.kernels = KernelSwitches(triton_router=True)
        router(x, None, decode=True)  # gradients wanted (the weight's): torch ops
        assert len(seen) == 1


def _hash_router(E, H, k, scoring, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    router = moe.Router(H, E, k, vocab_size=vocab, is_hash=True, scoring_func=scoring, routed_scaling_factor=1.5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) * H ** -0.5)
        router.tid2eid.copy_(torch.randint(0, E, (vocab, k), generator=g))
        router.tid2eid[0] = torch.arange(k).flip(0)  # descending in the table: stored ascending
        router.tid2eid[1] = 3  # one expert k times: k equal entries
    return router.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# the 1b config's hash layers (64 experts of 1024, k = 6), and H not a multiple of the program's step
@pytest.mark.parametrize("E,H,k", [(64, 1024, 6), (40, 200, 3)])
def test_the_hash_kernel_equals_the_routers_torch_ops(scoring, dtype, E, H, k):
    router, x = _hash_router(E, H, k, scoring, 50, E + H), _x(20, H, dtype, H)
    ids = torch.cat([torch.tensor([0, 1]), torch.randint(0, 50, (18,), generator=torch.Generator().manual_seed(1))])
    ids = ids.to(DEVICE)
    with torch.no_grad():
        experts, weights = rt.hash_route_step(x, router.weight, router.tid2eid, ids, scoring, 1.5)
        ref_experts, ref_weights = router.route(router.logits(x), ids)
    assert experts.dtype == torch.long and weights.dtype == torch.float32 and experts.shape == (20, k)
    assert torch.equal(experts, ref_experts)  # the table's experts, ascending, repeats kept
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_the_hash_kernel_is_taken_only_where_it_applies(monkeypatch):
    """runs_hash: the HASH switch, an element-wise scoring, and runs' conditions (CUDA, no gradient)."""
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    monkeypatch.setattr(rt, "runs", lambda *a: True)
    monkeypatch.setattr(rt, "HASH", True)
    assert rt.runs_hash(x, w, "sqrtsoftplus", True) and not rt.runs_hash(x, w, "softmax", True)
    monkeypatch.setattr(rt, "HASH", False)
    assert not rt.runs_hash(x, w, "sqrtsoftplus", True)
    monkeypatch.setattr(rt, "HASH", True)
    monkeypatch.setattr(rt, "runs", lambda *a: False)
    assert not rt.runs_hash(x, w, "sqrtsoftplus", True)


@needs_triton
def test_compiled_callers_get_the_kernels_result():
    router, x = _router(64, 256, 6, "sqrtsoftplus", 5), _x(16, 256, torch.bfloat16, 6)
    compiled = torch.compile(_kernel, backend="eager", fullgraph=True)
    with torch.no_grad():
        for a, b in zip(compiled(router, x), _kernel(router, x)):
            assert torch.equal(a, b)
