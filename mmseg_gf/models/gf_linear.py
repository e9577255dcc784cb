"""``GFLinear``: an ``nn.Linear`` over tokens on a grid whose backward is the
gradient filter (docs/gradient_filter.md#linear-layers-on-token-grids).

The grid is never guessed from ``N`` (a ``64 x 64`` and a ``32 x 128`` map
both give 4096 tokens; a cls token makes ``N`` odd): it comes from the
model, through a :class:`TokenGridSource` that the enclosing block's hooks
keep current, or that holds a fixed grid (a Swin window)."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import check_radius
from ..ops.backend.dispatch import tensor_signature
from ..ops.linear.function import (GradientFilterLinearFunction,
                                   gradient_filtered_linear)
from ..ops.linear.token_grid import TokenGrid, token_layout
from ..ops.linear.patch_mean_activation import PatchPartition, tag_output
from ..patching import plain_class
from .filtered_layer import FilteredLayer
from .call_plans import PLAIN, plan_for
from .gf_conv import warn_exact_backward, with_mmcv_wrapper


class TokenGridSource:
    """Where a filtered layer reads the token grid of its current call: set
    by the enclosing block's hooks per call, or fixed (Swin's windows).

    Args:
        grid: a fixed grid, or None to be set per call.
        name: what sets it, for messages (e.g. the block's path)."""

    def __init__(self, grid: Optional[TokenGrid] = None,
                 name: str = '') -> None:
        self.grid = grid
        self.name = name

    def set(self, grid: Optional[TokenGrid]) -> None:
        self.grid = grid

    def clear(self) -> None:
        self.grid = None

    def __repr__(self) -> str:
        return f'TokenGridSource({self.grid!r}, name={self.name!r})'


def plain_linear_classes() -> tuple:
    # NonDynamicallyQuantizableLinear: nn.MultiheadAttention's out_proj, a
    # plain Linear by another name.
    return with_mmcv_wrapper(nn.Linear) + (
        nn.modules.linear.NonDynamicallyQuantizableLinear, )


def is_filterable_linear(module: nn.Module) -> bool:
    """True for Linears whose forward is exactly ``F.linear`` (also when
    the lean region swapped their class: ``plain_class``)."""
    plain = plain_class(module)
    return plain in plain_linear_classes() or isinstance(module, GFLinear)


class GFLinear(FilteredLayer, nn.Linear):
    """A drop-in ``nn.Linear``: exact forward, gradient-filtered backward on
    the token grid its :class:`TokenGridSource` holds for the call.

    A call with no grid known (no source, or its hooks did not run: e.g. a
    block called outside its parent, or activation checkpointing
    recomputing the block in the backward) runs the exact backward and warns
    once per layer (:class:`GFExactBackwardWarning`); training stays correct
    and the warning names the layer. The selection refuses layers it finds
    no grid for before training, by name.

    Args:
        *args, **kwargs: as for ``nn.Linear``.
        radius (int): patch size ``r >= 1``.
        enabled (bool): ``False`` gives the exact backward. Default: True.
        grid_source (TokenGridSource | None): the grid of each call.
        token_dim (int): the token axis of the input (1 for ``(B, N, C)``;
            the ``H`` axis for an ``'hwc'`` grid). Default: 1.
    """

    def __init__(self, *args, radius: int = 4, enabled: bool = True,
                 grid_source: Optional[TokenGridSource] = None,
                 token_dim: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.radius = check_radius(radius)
        self.enabled = bool(enabled)
        self.grid_source = grid_source
        self.token_dim = int(token_dim)

    @classmethod
    def from_linear(cls, linear: nn.Linear, radius: int,
                    grid_source: Optional[TokenGridSource],
                    token_dim: int = 1, enabled: bool = True) -> 'GFLinear':
        """Wrap an existing Linear, **sharing** its Parameters (optimizers
        stay valid, ``state_dict`` keys and values are nn.Linear's).

        Raises:
            TypeError: for a Linear subclass whose forward is not plain
                ``F.linear`` (filtering would bypass what it adds).
        """
        if not is_filterable_linear(linear):
            raise TypeError(
                f'cannot gradient-filter a {type(linear).__module__}.'
                f'{type(linear).__name__}: only nn.Linear (and mmcv\'s '
                'Linear wrapper, nn.MultiheadAttention\'s out_proj) compute '
                'a plain F.linear; its forward would be bypassed')
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.training = linear.training
        new.register_parameter('weight', linear.weight)
        new.register_parameter('bias', linear.bias)
        new.radius = check_radius(radius)
        new.enabled = bool(enabled)
        new.grid_source = grid_source
        new.token_dim = int(token_dim)
        return new

    def current_grid(self) -> Optional[TokenGrid]:
        """The grid of the call now running, or None."""
        return None if self.grid_source is None else self.grid_source.grid

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return self._decided_forward(input)
        grid = self.current_grid()
        plan = self._call_plan(input, grid)
        if plan is None:
            return self._decided_forward(input)
        if plan is PLAIN:
            return F.linear(input, self.weight, self.bias)
        out = GradientFilterLinearFunction.apply(
            input, self.weight, self.bias, grid, self.radius, self.token_dim)
        # what an elementwise op after it may rely on (its g_y is read as
        # patch means on these patches; ops.linear.patch_mean_activation)
        return tag_output(out, plan)

    def _call_plan(self, input: Tensor, grid: Optional[TokenGrid]):
        """The call's plan: :data:`~.call_plans.PLAIN` (not filtering), the
        output's :class:`PatchPartition` (filtering, the shapes checked), or
        None (a case decided per call, a warning's); kept per call signature
        (input, parameters, grid, radius, token axis: :mod:`.call_plans`)."""
        key = (tensor_signature(input), tensor_signature(self.weight),
               tensor_signature(self.bias), grid, self.radius,
               self.token_dim, self.enabled, torch.is_grad_enabled())
        return plan_for(self, 'linear_plans', key, self._new_plan, input,
                        grid)

    def _new_plan(self, input: Tensor, grid: Optional[TokenGrid]):
        if (not self._filter_active(input, self.weight, self.bias)
                or input.numel() == 0 or self.weight.numel() == 0):
            return PLAIN
        if (grid is None or input.is_complex()
                or self.weight.is_complex()):
            return None
        layout = token_layout(grid, self.radius, tuple(input.shape),
                              self.token_dim)
        return PatchPartition.tokens(grid, self.radius, layout.dim)

    def _decided_forward(self, input: Tensor) -> Tensor:
        """:meth:`forward` deciding everything on this call."""
        if not self._filter_active(input, self.weight, self.bias) or \
                input.numel() == 0 or \
                self.weight.numel() == 0:
            # nothing to filter (an empty output or weight): the exact
            # backward, zero-sized or zero gradients, as nn.Linear gives
            return F.linear(input, self.weight, self.bias)
        grid = self.current_grid()
        if grid is None:
            warn_exact_backward(
                self, 'no token grid is known for this call (its grid '
                f'source {self.grid_source!r} was not set by the model)')
            return F.linear(input, self.weight, self.bias)
        if input.is_complex() or self.weight.is_complex():
            warn_exact_backward(self, 'complex-valued tensors')
            return F.linear(input, self.weight, self.bias)
        out = gradient_filtered_linear(input, self.weight, self.bias, grid,
                                       self.radius, self.token_dim)
        return tag_output(out, self._partition(grid, out))

    def _partition(self, grid: TokenGrid, t: Tensor) -> PatchPartition:
        return PatchPartition.tokens(grid, self.radius,
                                     grid.token_axis(t.shape, self.token_dim))

    def output_partition(self, input: Tensor,
                         output: Tensor) -> Optional[PatchPartition]:
        """The patches a filtered call on ``input`` tags its output with (even
        when run exact); None where a filtered call would run exact."""
        grid = self.current_grid()
        if (grid is None or input.is_complex()
                or self.weight.is_complex()):
            return None
        try:
            return self._partition(grid, output)
        except ValueError:
            return None

    def input_partition(self, input: Tensor) -> Optional[PatchPartition]:
        """The patches on which this layer's filtered ``g_x`` is constant for a
        call on ``input``; None without a grid."""
        grid = self.current_grid()
        if grid is None:
            return None
        try:
            return self._partition(grid, input)
        except ValueError:
            return None
