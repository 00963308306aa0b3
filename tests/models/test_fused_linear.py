"""The engine's fused input projections (layers/fused_linear.py): same outputs, same state dict,
and weights that alias the fused matrix, so in-place weight updates reach it."""

import copy

import torch

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_config import CSA
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config


def _models(seed=0):
    model = DeepseekV4ForCausalLM(tiny_config())
    init_deepseek_v4_(model, seed)
    fused = copy.deepcopy(model)
    fused.fuse_projections()
    return model.eval(), fused.eval()


def test_fused_forward_equals_separate_projections_and_state_dict_is_unchanged():
    model, fused = _models()
    assert {layer.self_attn.layer_type for layer in model.model.layers} >= {CSA}  # the 7-way fusion runs
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(fused(ids), model(ids), rtol=0, atol=1e-5)
    sd, fused_sd = model.state_dict(), fused.state_dict()
    assert list(fused_sd) == list(sd)
    assert all(torch.equal(fused_sd[k], sd[k]) for k in sd)


def test_weights_alias_the_fused_matrix():
    _, fused = _models()
    attn, mlp = fused.model.layers[2].self_attn, fused.model.layers[2].mlp
    rows = attn.q_a_proj.weight.shape[0]
    with torch.no_grad():
        attn.kv_proj.weight.fill_(0.5)  # what Engine.update_weights does: copy_ into the parameter
        mlp.shared_experts.up_proj.weight.zero_()
    assert torch.all(attn.fused_weight[rows:rows + attn.kv_proj.weight.shape[0]] == 0.5)
    assert attn.kv_proj.weight.data_ptr() == attn.fused_weight[rows:].data_ptr()
    up_rows = mlp.shared_experts.up_proj.weight.shape[0]
    assert torch.all(mlp.fused_weight[-up_rows:] == 0) and mlp.fused_weight[:-up_rows].abs().sum() > 0


def test_a_replaced_weight_is_fused_again():
    model, fused = _models(3)
    attn = fused.model.layers[1].self_attn
    before = attn.fused_weight
    fused.fuse_projections()
    assert attn.fused_weight is before  # intact: nothing rebuilt
    attn.q_a_proj.weight.data = attn.q_a_proj.weight.data.clone()  # re-allocated, e.g. by .to()
    with torch.no_grad():
        for m in (model, fused):
            m.model.layers[1].self_attn.q_a_proj.weight.mul_(0.5)
    fused.fuse_projections()
    assert attn.fused_weight is not before
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(fused(ids), model(ids), rtol=0, atol=1e-5)
