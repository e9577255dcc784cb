"""Frozen modules with random weights, for comparing a lean module with
its plain counterpart."""
import torch
from torch import nn


def frozen_random(module: nn.Module) -> nn.Module:
    """``module`` with seeded random Parameters (scale 0.5), none trained."""
    torch.manual_seed(0)
    for p in module.parameters():
        p.data.copy_(torch.randn_like(p) * 0.5)
        p.requires_grad_(False)
    return module
