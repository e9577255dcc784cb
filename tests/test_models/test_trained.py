"""mmseg_gf.models.trained.trains: what ``any(p.requires_grad for p in
module.parameters())`` says, for leaves, nested modules, a shared
parameter, a None parameter and a None child."""
import itertools

import torch
from torch import nn

from mmseg_gf.models.trained import trains


def _modules():
    shared = nn.Linear(3, 3)
    tree = nn.Sequential(nn.Conv2d(2, 2, 1, bias=False), nn.Sequential(
        nn.BatchNorm2d(2), shared), shared)
    tree.add_module('gone', None)
    return [nn.Linear(3, 3), nn.Conv2d(2, 2, 1, bias=False), tree,
            nn.MultiheadAttention(4, 2), nn.ReLU()]


def test_trains_is_any_parameter_needing_a_gradient():
    for module in _modules():
        params = list(module.parameters())
        for flags in itertools.product((False, True), repeat=len(params)):
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)
            assert trains(module) == any(
                p.requires_grad for p in module.parameters())
    assert not trains(nn.ReLU())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    frozen.extra = nn.Parameter(torch.zeros(1))
    assert trains(frozen)
