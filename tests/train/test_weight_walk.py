"""WeightWalk: the trainer's kept walk of its weights under canonical names."""

import torch
from torch import nn
from torch.nn.utils import parametrize

from lockstep.train.weight_walk import WeightWalk


def test_the_walk_follows_a_parametrization_registered_after_its_first_walk():
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    walk = WeightWalk(net)
    assert [n for n, _ in walk.items()] == list(net.state_dict())
    parametrize.register_parametrization(net[0], "weight", nn.Identity())  # weight moves under parametrizations
    got = dict(walk.items())
    assert list(got) == walk.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert torch.equal(got["0.weight"], net[0].parametrizations.weight.original)
