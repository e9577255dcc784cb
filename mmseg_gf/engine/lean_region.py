"""The lean trained region: what a training step keeps for backward.

Frozen norms, activations, dropout and the loss around a trained conv keep
full-size tensors; their lean variants (:mod:`mmseg_gf.models.lean`)
compute the same forward and gradients while keeping a per-channel scale,
a bit per element or low-resolution logits. ``lean=False`` leaves the
model as it is; outside the trained region a lean module runs its plain
forward.
"""
from collections import Counter
from typing import Dict

from torch import nn

from ..models.lean import is_lean, lean_kind, make_lean, make_plain
from ..models.segmentor import unwrap_model

__all__ = ['apply_lean_region', 'remove_lean_region', 'lean_counts']


def apply_lean_region(model: nn.Module) -> Dict[str, int]:
    """Make every module with a lean variant lean (idempotent).

    Returns:
        dict: kind (``norm``, ``activation``, ``dropout``, ``loss``) -> how
        many modules are now lean.
    """
    model = unwrap_model(model)
    for module in list(model.modules()):
        make_lean(module)
    return lean_counts(model)


def remove_lean_region(model: nn.Module) -> int:
    """Swap every lean module back to its plain class; returns how many."""
    return sum(make_plain(m) for m in list(unwrap_model(model).modules()))


def lean_counts(model: nn.Module) -> Dict[str, int]:
    """kind -> number of lean modules in ``model``."""
    return dict(Counter(lean_kind(m) for m in unwrap_model(model).modules()
                        if is_lean(m)))
