"""Conv blocks as one node on the GPU path: a filtered conv, the frozen
batch norm and the bit-masked activation after it fused
(:class:`~mmseg_gf.ops.conv_block.gpu.FilteredConvBlockFunction`).

mmcv's ``ConvModule`` and mmseg's ResNet blocks become the lean kind
``'conv_block'``: each conv, norm, activation triple runs as the fused
node where every condition holds, and as the three lean modules otherwise
(conditions and exactness: docs/lean_region.md, "Conv blocks on the GPU
path"; ``MMSEG_GF_CONV_BLOCKS=0`` switches it off)."""
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..ops.backend import dispatch
from ..ops.backend.dispatch import tensor_signature
from ..ops.conv_block import gpu as triton_conv_block
from .call_plans import plan_for
from .layer_kinds import CONV2D
from .trained import trains

try:
    from mmcv.cnn import ConvModule
except ImportError:  # no mmcv: no conv blocks
    ConvModule = None
try:
    from mmseg.models.backbones.resnet import BasicBlock, Bottleneck
except ImportError:  # no mmseg: no ResNet blocks
    BasicBlock = Bottleneck = None

__all__ = ['conv_block_mixin', 'LeanConvBlock', 'LeanBasicBlock',
           'LeanBottleneck', 'fused_parts', 'fused_geometry']


def conv_block_mixin(plain: type) -> Optional[type]:
    """The lean mixin for class ``plain`` whose forward is mmcv's
    ``ConvModule``'s or a ResNet block's, else None."""
    for base, mixin in ((ConvModule, LeanConvBlock),
                        (BasicBlock, LeanBasicBlock),
                        (Bottleneck, LeanBottleneck)):
        if (base is not None and issubclass(plain, base)
                and plain.forward is base.forward):
            return mixin
    return None


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _geometry_key(conv: nn.Module, x: Tensor) -> tuple:
    """What the conv's fused-call geometry may depend on: the input's
    signature, the conv's filter setting and parameters, the switches."""
    weight, bias = conv.weight, conv.bias
    return (tensor_signature(x), conv.radius, conv.enabled,
            weight.dtype, weight.device, weight.requires_grad,
            None if bias is None else bias.requires_grad,
            dispatch.switch_state())


def _decided_geometry(conv: nn.Module, x: Tensor) -> Optional[tuple]:
    if dispatch.choose('conv_block', x, conv.weight,
                       conv.bias).implementation.name != 'triton':
        return None
    call = conv.collapsed_call(x)
    return None if call is None else call[2:]


def fused_geometry(conv: nn.Module, x: Tensor) -> Optional[tuple]:
    """``(stride, padding, dilation, groups, radius, rows, cols)`` of the
    fused node for a call of ``conv`` on ``x``, None where it may not run:
    decided once per call signature (:mod:`.call_plans`), per call under
    ``torch.compile`` (a kept plan would be a guarded, mutated input)."""
    if torch.compiler.is_compiling():
        return _decided_geometry(conv, x)
    return plan_for(conv, 'block_geometry', _geometry_key(conv, x),
                    _decided_geometry, conv, x)


def fused_parts(conv: nn.Module, bn: nn.Module, act: nn.Module,
                x: Tensor) -> Optional[Tuple]:
    """The fused node's arguments after ``x`` for the triple ``conv, bn,
    act``, None where the three modules run (see the module docstring)."""
    if not (torch.is_grad_enabled() and CONV2D.is_filtered(conv)):
        return None
    # the first trained block's input needs no gradient, its conv does
    if not (x.requires_grad or trains(conv)):
        return None
    if _hooked(conv) or _hooked(bn) or _hooked(act):
        return None
    # the device first (in the geometry): on CPU tensors a call stops here
    geometry = fused_geometry(conv, x)
    if geometry is None:
        return None
    # what the lean norm and activation say of themselves (models.lean)
    norm = getattr(bn, 'frozen_affine', lambda: None)()
    mask = getattr(act, 'mask_arguments', lambda: None)()
    if norm is None or mask is None:
        return None
    return (conv.weight, conv.bias, *geometry, norm, mask)


def _fused(parts: Tuple, x: Tensor) -> Tensor:
    return triton_conv_block.FilteredConvBlockFunction.apply(x, *parts)


def _triple(conv: nn.Module, bn: nn.Module, act: nn.Module,
            x: Tensor) -> Tensor:
    parts = fused_parts(conv, bn, act, x)
    return act(bn(conv(x))) if parts is None else _fused(parts, x)


class LeanConvBlock:
    """The lean ``ConvModule``: one fused node where :func:`fused_parts`
    allows it, mmcv's forward otherwise."""

    def forward(self, x: Tensor, activate: bool = True,
                norm: bool = True) -> Tensor:
        parts = None
        if (activate and norm and self.order == ('conv', 'norm', 'act')
                and self.with_norm and self.with_activation
                and not self.with_explicit_padding
                and getattr(self, 'efficient_conv_bn_eval_forward',
                            None) is None):
            parts = fused_parts(self.conv, self.norm, self.activate, x)
        if parts is None:
            return super().forward(x, activate, norm)
        return _fused(parts, x)


class LeanBasicBlock:
    """mmseg's ResNet ``BasicBlock`` with ``conv1, norm1, relu`` fused where
    :func:`fused_parts` allows it; the rest as mmseg's forward."""

    def forward(self, x: Tensor) -> Tensor:
        parts = None if self.with_cp else fused_parts(
            self.conv1, self.norm1, self.relu, x)
        if parts is None:
            return super().forward(x)
        out = self.norm2(self.conv2(_fused(parts, x)))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class LeanBottleneck:
    """mmseg's ResNet ``Bottleneck`` with its first two triples fused where
    :func:`fused_parts` allows."""

    def forward(self, x: Tensor) -> Tensor:
        parts = None if self.with_cp or self.with_plugins else fused_parts(
            self.conv1, self.norm1, self.relu, x)
        if parts is None:
            return super().forward(x)
        out = _triple(self.conv2, self.norm2, self.relu, _fused(parts, x))
        out = self.norm3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)
