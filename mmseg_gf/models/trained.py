"""Whether a module trains any parameter, asked on every lean layer call.

``module.parameters()`` walks the module tree through a chain of
generators (several us on a CPU host); the modules' own parameter dicts,
read directly, answer the same in about one.
"""
from torch import nn

__all__ = ['trains']


def trains(module: nn.Module) -> bool:
    """Whether any parameter of ``module``, its children's included, needs a
    gradient."""
    for p in module._parameters.values():
        if p is not None and p.requires_grad:
            return True
    return any(child is not None and trains(child)
               for child in module._modules.values())
