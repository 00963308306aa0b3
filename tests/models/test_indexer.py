"""The C4 indexer's selection (layers/indexer.py): where index_topk covers every entry, `select` and
`select_indices` pick every visible entry without scoring, the set the scored path picks."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_config import CSA
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config


def _csa_attention(topk):
    model = DeepseekV4ForCausalLM(tiny_config(index_topk=topk))
    init_deepseek_v4_(model, 0)
    return next(layer.self_attn for layer in model.model.layers if layer.self_attn.layer_type == CSA)


def _inputs(attn, N=3, S=4, E=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ix = attn.compressor.indexer
    head_weights = torch.randn(N, S, ix.n_heads, generator=g)
    q_res = torch.randn(N, S, ix.q_b_proj.in_features, generator=g)
    positions = torch.randint(0, 4 * E + 4, (N, S), generator=g)
    keys = torch.randn(N, E, ix.head_dim, generator=g)
    return head_weights, q_res, positions, keys, attn.inv_freq


@pytest.mark.parametrize("E", [3, 6])
def test_every_visible_entry_is_picked_without_scores_when_topk_covers_them(monkeypatch, E):
    attn = _csa_attention(topk=6)
    ix = attn.compressor.indexer
    args = _inputs(attn, E=E)
    # the scored path's picks (what select would return were the scores computed)
    visible = ix.visible(args[2], E)
    picks, keep = ix.top_entries(ix.scores(*args), visible)
    want_mask = ix.picked(ix.scores(*args), visible)
    monkeypatch.setattr(type(ix), "scores", lambda *a: pytest.fail("scored where every entry is picked"))
    got = ix.select_indices(*args)
    assert got.shape == picks.shape
    for row_got, row_picks, row_keep in zip(got.flatten(0, 1), picks.flatten(0, 1), keep.flatten(0, 1)):
        assert sorted(row_got[row_got >= 0].tolist()) == sorted(row_picks[row_keep].tolist())
        assert row_got[row_got >= 0].tolist() == sorted(row_got[row_got >= 0].tolist())  # entry order
    assert torch.equal(ix.select(*args), torch.zeros(want_mask.shape).masked_fill(~want_mask, float("-inf")))
    assert visible.any() and not visible.all()  # the case has open and closed entries


def test_entries_beyond_topk_are_scored():
    attn = _csa_attention(topk=4)
    ix = attn.compressor.indexer
    args = _inputs(attn, E=9, seed=2)
    got = ix.select_indices(*args)
    picks, keep = ix.top_entries(ix.scores(*args), ix.visible(args[2], 9))
    assert torch.equal(got, torch.where(keep, picks, -1)) and got.shape[-1] == 4
    assert (got >= 0).sum(-1).max() == 4  # some rows see more than topk entries: a real choice


def _switched(model, **switches):
    from lockstep.models.layers.kernel_switch import KernelSwitches, set_kernel_switches

    return set_kernel_switches(model, KernelSwitches(**switches))


@pytest.mark.skipif(__import__("lockstep.models.layers.index_scores_triton", fromlist=["triton"]).triton is None,
                    reason="triton is not installed")
def test_the_index_kernel_scores_and_picks_as_the_torch_ops():
    """KernelSwitches.triton_index (index_scores_triton.py, under the interpreter here): the visible
    entries' scores equal the einsum form's to fp32 rounding, the others are -inf, and the picks are
    the same set."""
    attn = _csa_attention(topk=4).to(DEVICE)
    ix = attn.compressor.indexer
    args = [t.to(DEVICE) for t in _inputs(attn, E=9, seed=2)]
    want, want_indices = ix.scores(*args), ix.select_indices(*args)
    _switched(attn, triton_index=True)
    got = ix.scores(*args)
    visible = ix.visible(args[2], 9)
    torch.testing.assert_close(got[visible], want[visible], rtol=1e-5, atol=1e-6)
    assert torch.isneginf(got[~visible]).all() and visible.any() and not visible.all()
    assert torch.equal(ix.select_indices(*args), want_indices)


def test_a_model_with_the_index_kernel_gives_the_same_logits(monkeypatch):
    """The whole forward (tiny config: index_topk 3, so the C4 layers choose) with the switch on: the
    kernel scores, the picks are the same, so the logits are the same bit for bit."""
    from lockstep.models.layers.indexer import Indexer

    model = DeepseekV4ForCausalLM(tiny_config())
    init_deepseek_v4_(model, 0)
    model.to(DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = model(ids)
    _switched(model, triton_index=True)
    calls, kernel_scores = [], Indexer.kernel_scores
    monkeypatch.setattr(Indexer, "kernel_scores", lambda self, *a: calls.append(1) or kernel_scores(self, *a))
    got = model(ids)
    assert calls and torch.equal(got, want)


def test_training_with_the_index_kernel_changes_nothing_but_rounding():
    """A training forward and backward with the switch on (the kernel under no_grad: the scores
    feed no loss): the same loss and gradients (tests/switched_training.py)."""
    from switched_training import assert_switch_changes_nothing

    assert_switch_changes_nothing("triton_index", seed=6, shape=(1, 24))
