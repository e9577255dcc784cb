"""What every layer kind's filtered module is: :class:`FilteredLayer`.

A kind's filtered module (``GFConv2d``, ``GFLinear``,
``GFMultiheadAttention``) subclasses its plain module and this base, first
(``class GFConv2d(FilteredLayer, nn.Conv2d)``), so that the rest of the
plugin reads the same few things of any of them: its ``radius`` and
``enabled`` (set by the surgery, :meth:`LayerKind.set_filter
<mmseg_gf.models.layer_kinds.LayerKind.set_filter>`), whether a call runs
the filter (the accounting's kept rules), and the patches its output and its
input gradient are constant on (the patch-mean GELU rule,
:mod:`mmseg_gf.engine.patch_mean_activations`, and the budget's profile,
:mod:`mmseg_gf.accounting.step_profile`).
"""
from typing import Optional

import torch
from torch import Tensor

from ..ops.linear.patch_mean_activation import PatchPartition

__all__ = ['FilteredLayer']


class FilteredLayer:
    """The base of the kinds' filtered modules (a mixin: it holds no state
    of its own and defines no ``__init__``).

    Attributes:
        radius: patch size ``r`` of the filter.
        enabled: False gives the exact backward (the "vanilla" baseline
            with the same layers).
    """

    radius: int
    enabled: bool

    def _filter_active(self, input: Tensor, *params: Optional[Tensor]
                       ) -> bool:
        """Whether a call on ``input`` runs the filtered backward: enabled,
        autograd recording, and the input or a parameter needing a
        gradient. ``params``: the parameters the call uses (a conv may be
        handed a fused weight); by default the module's own."""
        if not (self.enabled and torch.is_grad_enabled()):
            return False
        if input.requires_grad:
            return True
        if not params:
            params = tuple(self.parameters(recurse=False))
        for param in params:
            if param is not None and param.requires_grad:
                return True
        return False

    def output_partition(self, input: Tensor,
                         output: Tensor) -> Optional[PatchPartition]:
        """The patches a filtered call on ``input`` tags its ``output`` with
        (its ``g_y`` is read as patch means on them), whether or not this
        call ran filtered; None where it tags none (the default: a kind
        whose output mixes its patches, as an attention's)."""
        return None

    def input_partition(self, input: Tensor) -> Optional[PatchPartition]:
        """The patches on which the filtered ``g_x`` of a call on ``input``
        is constant, when they are a partition an elementwise op before
        this layer may rely on; None otherwise (the default)."""
        return None

    def extra_repr(self) -> str:
        return (f'{super().extra_repr()}, radius={self.radius}'
                f'{"" if self.enabled else ", enabled=False"}')
