"""What gradient filtering did to a segmentor, kept on the segmentor.

The surgery, the config rewrite, the hooks, the tools and the measurements
all need to know which layers were chosen, in which mode, whether the lean
region is on and, for a budget, what the budget chose. One
:class:`GradientFilterState` attached to the segmentor answers all of it
(:func:`get_state`), instead of loose private attributes.
"""
from dataclasses import dataclass, field
from typing import Any, List, Optional, Set

from torch import nn

from ..models.segmentor import unwrap_model

__all__ = ['GradientFilterState', 'STATE_ATTR', 'get_state', 'set_state']

#: The segmentor attribute holding its :class:`GradientFilterState`.
STATE_ATTR = '_gf_state'


@dataclass
class GradientFilterState:
    """The gradient-filter settings applied to one segmentor.

    Attributes:
        layers: the chosen layers
            (:class:`~mmseg_gf.engine.selection.LayerChoice`, execution
            order; ``module`` is the layer kind's filtered module, e.g.
            the GFConv2d).
        mode: ``'gf'`` (filtered backward) or ``'vanilla'`` (exact).
        lean: whether the lean trained region is on.
        budget: the :class:`~mmseg_gf.accounting.budget.BudgetChoice` when
            the layers came from a ``budget`` setting, else None.
        keep_frozen_aux_heads: run every auxiliary head in training, also
            the frozen ones (:mod:`~mmseg_gf.engine.frozen_aux_heads`);
            False leaves frozen heads out.
        log_frozen_aux_losses: return a skipped head's losses, computed
            without autograd, for the log.
        logged_frozen_aux_heads: paths of the skipped heads already logged
            (each is logged once).
        reuse_cpu_memory: GradFilterHook keeps freed CPU memory for reuse
            when training on CPU (:mod:`~mmseg_gf.engine.cpu_memory`).
        patch_mean_gelus: paths of the GELUs keeping the patch means of
            their derivative (:mod:`~mmseg_gf.engine.patch_mean_activations`).
    """

    layers: List[Any]
    mode: str = 'gf'
    lean: bool = True
    budget: Optional[Any] = None
    keep_frozen_aux_heads: bool = False
    log_frozen_aux_losses: bool = False
    logged_frozen_aux_heads: Set[str] = field(default_factory=set)
    reuse_cpu_memory: bool = False
    patch_mean_gelus: List[str] = field(default_factory=list)


def get_state(model: nn.Module) -> Optional[GradientFilterState]:
    """The state of ``model`` (wrapped or not); None when gradient
    filtering was not applied."""
    return getattr(unwrap_model(model), STATE_ATTR, None)


def set_state(model: nn.Module, state: GradientFilterState) -> None:
    """Attach ``state`` to ``model`` (wrapped or not)."""
    setattr(unwrap_model(model), STATE_ATTR, state)
