"""mHC's streams handed through the projection and the collapse to the combine
(hyper_connection.HyperConnection.pre, `threads_streams`: the trainer's eager forward on a GPU, forced
here on the CPU with the kernels under Triton's interpreter): the same values as the streams read
by three consumers, gradients to bf16 rounding (one rounding of each sum instead of autograd's
bf16 additions), and no autograd addition over the streams in the backward. Also the two kernels'
addends against their formulas."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from devices import DEVICE
from lockstep.models.layers import hyper_connection as hc
from lockstep.models.layers import scaled_projection_triton as spt
from lockstep.models.layers import stream_mix_triton as sm

needs_triton = pytest.mark.skipif(sm.triton is None, reason="triton is not installed")
T, N, D = 6, 4, 160


class _StreamAdds(TorchDispatchMode):
    """Counts aten add / add_ calls whose output has the streams' shape."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and tuple(out.shape) == self.shape:
            self.count += 1
        return out


def _block(seed=0):
    torch.manual_seed(seed)
    conn = hc.HyperConnection(N, D, sinkhorn_iters=5, hc_eps=1e-6, norm_eps=1e-6).to(DEVICE)
    with torch.no_grad():
        conn.fn.normal_(0, 0.05)
        conn.base.normal_(0, 0.1)
    streams = (torch.randn(2, T // 2, N, D) * 2).to(DEVICE, torch.bfloat16)
    w = torch.randn(D).to(DEVICE, torch.bfloat16)
    return conn, streams, w


def _run(monkeypatch, threaded: bool):
    """A block around the connection: pre, y = collapsed * w, the combine, a loss; -> (loss, the
    gradients of the streams, fn, base and scale, the streams additions the backward made)."""
    monkeypatch.setattr(hc, "threads_streams", lambda streams, fn: threaded)
    conn, streams, w = _block()
    streams.requires_grad_()
    x, collapsed, post, comb = conn.pre(streams)
    assert (x is streams) != threaded
    out = hc.hc_combine(x, collapsed * w, post, comb)
    loss = (out.float() * torch.linspace(-1, 1, D, device=DEVICE)).sum()
    adds = _StreamAdds(streams.shape)
    with adds:
        loss.backward()
    return loss, [streams.grad, conn.fn.grad, conn.base.grad, conn.scale.grad], adds.count


@needs_triton
def test_handed_through_streams_give_the_same_loss_and_gradients_without_autograd_sums(monkeypatch):
    loss_ref, grads_ref, adds_ref = _run(monkeypatch, threaded=False)
    loss, grads, adds = _run(monkeypatch, threaded=True)
    assert adds_ref >= 2 and adds == 0, (adds_ref, adds)  # three consumers summed, or none
    assert torch.equal(loss, loss_ref)  # the forward's bits are the same
    for got, want in zip(grads, grads_ref):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_threads_streams_only_for_the_eager_bf16_forward_on_a_gpu():
    conn, streams, _ = _block()
    assert not hc.threads_streams(streams.requires_grad_(), conn.fn) or DEVICE == "cuda"
    with torch.no_grad():
        assert not hc.threads_streams(streams, conn.fn)
    assert not hc.threads_streams(streams.detach().float().requires_grad_(), conn.fn)


@needs_triton
def test_the_collapse_backward_adds_its_addend_in_one_rounding():
    g = torch.Generator().manual_seed(5)
    pre = (torch.rand(T, N, generator=g) + 0.5).to(DEVICE)
    streams, addend = ((torch.randn(T, N, 1100, generator=g) * 3).to(DEVICE, torch.bfloat16) for _ in range(2))
    grad = torch.randn(T, 1100, generator=g).to(DEVICE, torch.bfloat16)
    d_pre, d_x = sm.collapse_backward_op(pre, streams, grad, addend)
    ref_pre, ref_x = sm.collapse_backward_reference(pre, streams, grad, addend)
    assert torch.equal(d_pre, sm.collapse_backward_op(pre, streams, grad)[0])  # d pre does not see the addend
    want = (addend.double() + pre.double().unsqueeze(-1) * grad.double().unsqueeze(1)).to(torch.bfloat16)
    if DEVICE == "cpu":
        assert torch.equal(d_x, ref_x)
    torch.testing.assert_close(d_x.float(), want.float(), rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(d_pre, ref_pre, rtol=1e-5, atol=1e-5 * ref_pre.abs().max().item())


@pytest.mark.skipif(spt.triton is None, reason="Triton is not installed")
def test_the_streams_gradient_kernel_adds_its_addend_before_rounding():
    g = torch.Generator().manual_seed(9)
    rows, J, cols = 70, 24, 300
    gr, fn, s = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((rows, J), (J, cols), (rows, 1)))
    x, addend = (torch.randn(rows, cols, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    got = spt.streams_grad(gr, fn, s, x, addend)
    want = gr.double() @ fn.double() - s.double() * x.double() + addend.double()
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=8e-3, atol=1e-5)


def _model_grads(monkeypatch, threaded: bool):
    """The tiny DeepSeek-V4 in bf16, one forward and backward with the streams handed through or not
    -> (loss, parameter gradients, the stream-shaped additions of the backward)."""
    from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
    from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config

    monkeypatch.setattr(hc, "threads_streams", lambda streams, fn: threaded)
    config = tiny_config()
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, seed=0)
    model = model.to(DEVICE, torch.bfloat16)
    ids = torch.randint(2, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits = model(ids)
    logits = getattr(logits, "logits", logits)
    loss = logits.float().square().mean()
    adds = _StreamAdds((2, 12, config.hc_mult, config.hidden_size))
    with adds:
        loss.backward()
    return loss, {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}, adds.count


@needs_triton
def test_a_whole_model_hands_its_streams_through_every_block(monkeypatch):
    """The decoder layers thread each block's streams (attention and MoE combines alike): the same
    loss bits, gradients to bf16 rounding (both ~1.2% from the fp32 model's on this model, 1e-4 apart),
    and the backward's stream-shaped additions two fewer a block (one is left, outside the blocks)."""
    loss_ref, grads_ref, adds_ref = _model_grads(monkeypatch, threaded=False)
    loss, grads, adds = _model_grads(monkeypatch, threaded=True)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    diff = sum(((grads[n] - grads_ref[n]) ** 2).sum() for n in grads) ** 0.5
    assert diff < 2e-3 * sum((g ** 2).sum() for g in grads_ref.values()) ** 0.5
    from lockstep.models.deepseek_v4_init import tiny_config

    blocks = 2 * tiny_config().num_hidden_layers  # attention and MoE, each with its connection
    assert adds_ref - adds == 2 * blocks and adds <= 1, (adds, adds_ref)  # an add and an add_ fewer a block
