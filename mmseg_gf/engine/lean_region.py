"""The lean trained region: what a training step keeps for backward.

Gradient filtering shrinks what a trained conv keeps (its input's patch sums
instead of its input), but a conv is surrounded by layers that keep full-size
tensors of their own: the frozen norm after it, the activation, dropout, and
the decode head's loss on logits upsampled to the label size.
:func:`apply_lean_region` swaps those modules of a segmentor for their lean
variants (:mod:`mmseg_gf.models.lean`), which compute the same forward and
the same gradients while keeping a per-channel scale, one bit per element, or
the low-resolution logits. It applies to ``mode='gf'`` and ``'vanilla'``
alike; ``lean=False`` in the gradient-filter settings leaves the model as it
is, for comparison.

Modules outside the trained region are swapped too: a lean module runs its
plain forward whenever autograd does not record it.
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
        many modules of the model now are lean.
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
