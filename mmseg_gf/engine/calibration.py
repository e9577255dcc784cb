"""The paper's calibration step (Supplement D.3): which parameters train,
which norms update; the "Calibration" row of Tables 3 and 9.
"""
from typing import List, Sequence

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..models.segmentor import unwrap_model

__all__ = ['freeze_for_calibration', 'set_norm_stats_train']


def freeze_for_calibration(model: nn.Module,
                           trainable: Sequence[str]) -> List[str]:
    """Freeze every parameter of ``model`` outside the ``trainable`` modules.

    Returns:
        The names of the trainable parameters.

    Raises:
        ValueError: a path names no module, or nothing would be trained.
    """
    model = unwrap_model(model)
    modules = dict(model.named_modules())
    missing = [p for p in trainable if p not in modules]
    if missing:
        raise ValueError(f'CalibrationHook trainable: no module {missing} in '
                         f'{type(model).__name__}')
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for path in trainable:
        for name, p in modules[path].named_parameters():
            p.requires_grad_(True)
            names.append(f'{path}.{name}' if path else name)
    if not names:
        raise ValueError(
            f'CalibrationHook: {list(trainable)} hold no parameters')
    return names


def set_norm_stats_train(model: nn.Module) -> int:
    """Put every BN layer in train mode; returns how many."""
    count = 0
    for m in unwrap_model(model).modules():
        if isinstance(m, _BatchNorm):
            m.train()
            count += 1
    return count
