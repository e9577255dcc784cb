"""Whether a module trains any parameter, asked on every lean layer call.

``module.parameters()`` walks the module tree through a chain of
generators (several us on a CPU host); a leaf module's own parameter dict
answers the same in well under one.
"""
from torch import nn

__all__ = ['trains']


def trains(module: nn.Module) -> bool:
    """Whether any parameter of ``module``, its children's included, needs a
    gradient."""
    if module._modules:
        return any(p.requires_grad for p in module.parameters())
    return any(p is not None and p.requires_grad
               for p in module._parameters.values())
