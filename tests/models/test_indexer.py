"""The C4 indexer's selection (layers/indexer.py): where index_topk covers every entry, `select` and
`select_indices` pick every visible entry without scoring, the set the scored path picks."""

import pytest
import torch

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
