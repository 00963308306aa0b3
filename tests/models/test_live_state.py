"""LiveState gives what state_dict(keep_vars=True) gives, read live, for the trainer's weight walk."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from lockstep.models.live_state import LiveState, StaleLiveState


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4))
        self.register_buffer("table", torch.arange(4))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.head = nn.Linear(4, 3)
        self.head.weight = nn.Parameter(torch.ones(3, 4))


def as_lists(pairs):
    pairs = list(pairs)
    return [n for n, _ in pairs], [t for _, t in pairs]


def test_the_same_names_order_and_tensors_as_state_dict_and_it_reads_live():
    net = Net()
    net.tied = nn.Linear(4, 3)
    net.tied.weight = net.head.weight  # tied: both names, as state_dict gives them
    live = LiveState.of(net)
    names, tensors = as_lists(live.items())
    ref_names, ref_tensors = as_lists(net.state_dict(keep_vars=True).items())
    assert names == ref_names and "scratch" not in names and "tied.weight" in names
    assert all(a is b for a, b in zip(tensors, ref_tensors))
    net.a.weight = nn.Parameter(torch.full((4, 3), 2.0))  # replaced: seen
    net.b[1].weight.data = torch.full((4,), 3.0)  # data swapped: seen
    got = dict(live.items())
    assert got["a.weight"] is net.a.weight and torch.equal(got["b.1.weight"], torch.full((4,), 3.0))
    assert dict(live.items()).keys() == net.state_dict().keys()
    detached = dict(live.items(detached=True))  # state_dict()'s tensors: `.data` of each
    assert detached.keys() == got.keys() and all(
        not t.requires_grad and t.data_ptr() == got[n].data_ptr() for n, t in detached.items())
    assert any(t.requires_grad for t in got.values())


def test_a_parametrization_registered_since_is_an_error_naming_the_weight():
    net = Net()
    live = LiveState.of(net)
    parametrize.register_parametrization(net.a, "weight", nn.Identity())
    with pytest.raises(StaleLiveState, match=r"a\.weight: no longer an attribute"):
        list(live.items())
    again = LiveState.of(net)
    assert as_lists(again.items())[0] == list(net.state_dict(keep_vars=True))


def test_a_module_whose_state_dict_is_not_the_plain_walk_gives_none():
    class Renaming(nn.Linear):
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            destination[prefix + "w"] = self.weight

    net = Net()
    net.odd = Renaming(2, 2)
    assert LiveState.of(net) is None
    hooked = Net()
    hooked.register_state_dict_post_hook(lambda module, state, prefix, local_metadata: None)
    assert LiveState.of(hooked) is None

