"""What gradient filtering did to a segmentor, kept on the segmentor.

One :class:`GradientFilterState` answers the surgery, rewrite, hooks and
tools, instead of loose private attributes.
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
        layers: the chosen layers, execution order, ``module`` filtered.
        mode: ``'gf'`` (filtered backward) or ``'vanilla'`` (exact).
        budget: the :class:`~mmseg_gf.accounting.budget.BudgetChoice`, or None.
        logged_frozen_aux_heads: skipped heads already logged (once each).
        patch_mean_gelus: GELUs keeping their derivative's patch means.
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
    """The state of ``model`` (wrapped or not); None when not filtered."""
    return getattr(unwrap_model(model), STATE_ATTR, None)


def set_state(model: nn.Module, state: GradientFilterState) -> None:
    """Attach ``state`` to ``model`` (wrapped or not)."""
    setattr(unwrap_model(model), STATE_ATTR, state)
