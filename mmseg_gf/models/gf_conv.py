"""``GFConv2d``: an ``nn.Conv2d`` whose backward is the gradient filter."""

import warnings
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import check_radius
from ..ops.backend import dispatch
from ..ops.backend.dispatch import tensor_signature
from ..ops.conv.function import (as_pair, collapsed_patches, conv_geometry,
                                 filtered_conv, resolve_padding)
from ..ops.linear.patch_mean_activation import PatchPartition, tag_output
from ..patching import plain_class
from .call_plans import PLAIN, plan_for
from .filtered_layer import FilteredLayer


class CallPlan(NamedTuple):
    """What a filtered call runs, decided once per call signature: the
    dispatcher's implementation, its arguments after ``(x, weight, bias)``
    and the patches its output is tagged with."""
    run: Callable
    arguments: tuple
    partition: PatchPartition


_CONV_ATTRIBUTES = ('in_channels', 'out_channels', 'kernel_size', 'stride',
                    'padding', 'dilation', 'transposed', 'output_padding',
                    'groups', 'padding_mode',
                    '_reversed_padding_repeated_twice')


def sharing_conv(cls, conv: nn.Module, radius: int,
                 enabled: bool = True) -> nn.Module:
    """A ``cls`` (a filtered conv class, any dimension) built from ``conv``
    without running ``__init__``: ``conv``'s hyper-parameters and training
    flag copied, its weight and bias Parameters **shared**. Sharing (not
    copying) keeps optimizers built before the swap valid and keeps
    ``state_dict`` keys and values identical."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for name in _CONV_ATTRIBUTES:
        setattr(new, name, getattr(conv, name))
    new.training = conv.training
    new.register_parameter('weight', conv.weight)
    new.register_parameter('bias', conv.bias)
    new.radius = check_radius(radius)
    new.enabled = bool(enabled)
    return new


class GFExactBackwardWarning(UserWarning):
    """A filtered layer's call ran with the exact backward: the filter
    cannot apply."""


def warn_exact_backward(module: nn.Module, reason: str) -> None:
    """Warn once per layer that a call runs the exact backward, for
    ``reason`` (a call its filter does not cover); every filtered layer
    kind uses it, so the message names the layer the same way."""
    if getattr(module, '_gf_warned_exact_backward', False):
        return
    module._gf_warned_exact_backward = True
    name = plain_class(module).__name__
    warnings.warn(
        f'{name}({module.extra_repr()}): falling back to the exact backward '
        f'for {reason}; this layer is trained without the gradient filter',
        GFExactBackwardWarning, stacklevel=3)


def exact_backward_reason(input: Tensor, weight: Tensor) -> Optional[str]:
    """Why a conv call cannot be gradient-filtered, or None if it can: only a
    complex-valued conv is refused (docs/gradient_filter.md defines real
    ones, whatever kernel, stride, padding, dilation, groups, size or dtype).
    """
    if input.is_complex() or weight.is_complex():
        return ('complex-valued tensors (docs/gradient_filter.md defines the '
                'gradient filter for real-valued convolutions only)')
    return None


def with_mmcv_wrapper(torch_class: type) -> tuple:
    """``torch_class`` and mmcv's wrapper of the same name, when mmcv is
    installed (its wrappers only add empty-tensor support around torch's
    ``Conv2d``, ``Linear``, ...: the same computation)."""
    classes = [torch_class]
    try:
        from mmcv.cnn.bricks import wrappers
        classes.append(getattr(wrappers, torch_class.__name__))
    except (ImportError, AttributeError):
        pass
    return tuple(classes)


def _plain_conv_classes() -> tuple:
    return with_mmcv_wrapper(nn.Conv2d)


def is_filterable_conv(module: nn.Module) -> bool:
    """True for convs whose forward is exactly ``nn.Conv2d``'s convolution
    (also when :mod:`.lean` swapped their class: ``plain_class``)."""
    plain = plain_class(module)
    return plain in _plain_conv_classes() or isinstance(module, GFConv2d)


class GFConv2d(FilteredLayer, nn.Conv2d):
    """A drop-in ``nn.Conv2d``: exact forward, gradient-filtered backward.

    Built by mmcv as ``conv_cfg=dict(type='GFConv2d', radius=4)``. The filter
    acts only while autograd records, and lives in ``_conv_forward`` so that
    callers bypassing ``forward`` (mmcv's ``efficient_conv_bn_eval``) get it.

    Args:
        radius (int): patch size ``r >= 1``.
        enabled (bool): ``False`` gives the exact backward (the vanilla
            baseline on the same layers). Default: True.
    """

    def __init__(self, *args, radius: int = 4, enabled: bool = True,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.radius = check_radius(radius)
        self.enabled = bool(enabled)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, radius: int,
                  enabled: bool = True) -> 'GFConv2d':
        """Wrap an existing conv, **sharing** its Parameters
        (:func:`sharing_conv`).

        Raises:
            TypeError: for a conv class whose forward is not a plain
                convolution (e.g. weight-standardised ``ConvWS``): filtering
                it would silently change what it computes.
        """
        if not is_filterable_conv(conv):
            raise TypeError(
                f'cannot gradient-filter a {type(conv).__module__}.'
                f'{type(conv).__name__}: only nn.Conv2d (and mmcv\'s '
                'Conv2d wrapper) compute a plain convolution; its forward '
                'would be bypassed or changed')
        return sharing_conv(cls, conv, radius, enabled)

    def _conv_forward(self, input: Tensor, weight: Tensor,
                      bias: Optional[Tensor]) -> Tensor:
        if torch.compiler.is_compiling():
            return self._decided_conv_forward(input, weight, bias)
        plan = self._call_plan(input, weight, bias)
        if plan is None:
            return self._decided_conv_forward(input, weight, bias)
        if plan is PLAIN:
            return super()._conv_forward(input, weight, bias)
        out = plan.run(input, weight, bias, *plan.arguments)
        # what an elementwise op after it may rely on (its g_y is read as
        # patch means on these patches; ops.linear.patch_mean_activation)
        return tag_output(out, plan.partition)

    def _call_plan(self, input: Tensor, weight: Tensor,
                   bias: Optional[Tensor]):
        """The call's plan: :data:`~.call_plans.PLAIN` (not filtering), a
        :class:`CallPlan`, or None (a case decided per call); kept per call
        signature (input, parameters, radius, switches: :mod:`.call_plans`).
        """
        key = (tensor_signature(input), tensor_signature(weight),
               tensor_signature(bias), self.radius, self.enabled,
               torch.is_grad_enabled(), dispatch.switch_state())
        return plan_for(self, 'conv_plans', key, self._new_plan, input,
                        weight, bias)

    def _new_plan(self, input: Tensor, weight: Tensor,
                  bias: Optional[Tensor]):
        if not self._filter_active(input, weight, bias):
            return PLAIN
        if (input.dim() != 4 or input.numel() == 0 or weight.numel() == 0
                or exact_backward_reason(input, weight) is not None
                or self.padding_mode != 'zeros'):
            return None
        pad, extra = resolve_padding(self.padding, self.kernel_size,
                                     self.dilation)
        if extra is not None:
            return None
        stride, dilation = as_pair(self.stride), as_pair(self.dilation)
        arguments = (stride, pad, dilation, self.groups, self.radius)
        choice = dispatch.choose('conv', input, weight, bias, *arguments)
        out_hw = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s
                  in zip(input.shape[2:], pad, dilation, weight.shape[2:],
                         stride)]
        return CallPlan(choice.implementation.run,
                        arguments + tuple(choice.launch),
                        PatchPartition.conv_map(self.radius, *out_hw))

    def _decided_conv_forward(self, input: Tensor, weight: Tensor,
                              bias: Optional[Tensor]) -> Tensor:
        """:meth:`_conv_forward` deciding everything on this call."""
        if not self._filter_active(input, weight, bias):
            return super()._conv_forward(input, weight, bias)
        if input.numel() == 0 or weight.numel() == 0:
            # Nothing to filter (empty batch / channels): the exact backward
            # gives the spec's answer, empty or all-zero gradients.
            return super()._conv_forward(input, weight, bias)
        reason = exact_backward_reason(input, weight)
        if reason is not None:
            warn_exact_backward(self, reason)
            return super()._conv_forward(input, weight, bias)
        if input.dim() == 3:  # unbatched (C, H, W), as nn.Conv2d accepts
            return self._filtered_conv(input.unsqueeze(0), weight,
                                       bias).squeeze(0)
        out = self._filtered_conv(input, weight, bias)
        return tag_output(out, PatchPartition.conv_map(self.radius,
                                                       *out.shape[-2:]))

    def collapsed_call(self, input: Tensor) -> Optional[tuple]:
        """``(weight, bias, stride, padding, dilation, groups, radius, rows,
        cols)`` of a call on ``input`` that runs filtered with a kernel
        collapsing on both axes (``rows`` / ``cols``: its input patches),
        as the fused routes take it; None for any other call (not
        filtering, other padding, the exact backward's cases, taps in other
        patches)."""
        if (input.dim() != 4 or input.numel() == 0
                or self.padding_mode != 'zeros'
                or isinstance(self.padding, str)
                or not self._filter_active(input, self.weight, self.bias)
                or exact_backward_reason(input, self.weight) is not None):
            return None
        stride, padding = as_pair(self.stride), as_pair(self.padding)
        dilation = as_pair(self.dilation)
        patches = collapsed_patches(input, self.weight, stride, padding,
                                    dilation, self.radius)
        if patches is None:
            return None
        return (self.weight, self.bias, stride, padding, dilation,
                self.groups, self.radius, *patches)

    def output_partition(self, input: Tensor,
                         output: Tensor) -> Optional[PatchPartition]:
        """The patches a filtered call on ``input`` tags its ``output``
        with, whether or not this call ran filtered (the budget's probe
        runs the exact backward: :mod:`mmseg_gf.accounting.step_profile`);
        None where a filtered call would run the exact backward (an unbatched
        input, or one of :func:`exact_backward_reason`'s cases)."""
        if (input.dim() != 4 or input.numel() == 0
                or exact_backward_reason(input, self.weight) is not None):
            return None
        return PatchPartition.conv_map(self.radius, *output.shape[-2:])

    def input_partition(self, input: Tensor) -> Optional[PatchPartition]:
        """The patches on which this layer's filtered ``g_x`` is constant,
        when they are the ``r x r`` tiles of ``input``'s map from 0 (stride
        1, ``c = 0``, output as large as the input, zero padding of
        numbers); else None (docs/gradient_filter.md#patch-geometry)."""
        if (input.dim() != 4 or self.padding_mode != 'zeros'
                or isinstance(self.padding, str)):
            return None
        geometry = conv_geometry(input, self.weight, self.stride,
                                 self.padding, self.dilation, self.radius)
        if not all(g.in_start == 0 and g.in_patch == self.radius
                   and g.out_size == g.in_size for g in geometry):
            return None
        return PatchPartition.conv_map(self.radius, *input.shape[-2:])

    def _filtered_conv(self, input: Tensor, weight: Tensor,
                       bias: Optional[Tensor]) -> Tensor:
        padding = self.padding
        if self.padding_mode != 'zeros':
            input = F.pad(input, self._reversed_padding_repeated_twice,
                          mode=self.padding_mode)
            padding = (0, 0)
        pad, extra = resolve_padding(padding, self.kernel_size, self.dilation)
        if extra is not None:
            input = F.pad(input, extra)
        return filtered_conv(input, weight, bias, self.stride, pad,
                             self.dilation, self.groups, self.radius)
