"""Lean variants of the modules around a trained conv (see :mod:`mmseg_gf.ops.lean`).

:func:`make_lean` swaps a module's class for a subclass of it (the class of
the module itself, e.g. mmengine's reverted ``_BatchNormXd``, not a fixed
base), so ``isinstance`` checks, ``state_dict`` keys, hooks and the forward's
numbers are unchanged; :func:`make_plain` swaps it back. A lean module runs
its plain forward unless autograd records it (grad mode on and an input that
requires a gradient), so swapping every module of a model costs nothing
outside the trained region.

What becomes lean:

* ``_BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, mmengine's reverted
  SyncBN) in eval mode with no trainable parameter: keeps ``C`` scales.
* ``ReLU``, ``ReLU6`` / ``Hardtanh``, ``LeakyReLU``: keep 1 bit per element.
* ``Dropout`` (element-wise): keeps 1 bit per element.
* ``AdaptiveAvgPool2d`` to more than 1x1 (PSPNet's pyramid): keeps the
  input's shape only.
* decode heads whose loss is mmseg's ``BaseDecodeHead.loss_by_feat``: keep
  the low-resolution logits, not the upsampled ones
  (:func:`make_lean` on the head).
* ``nn.Conv2d`` and mmcv's ``Conv2d`` (not ``GFConv2d``) while frozen, with
  zero padding of integer sizes: keep nothing (the weight is a live
  Parameter); ``nn.Linear`` (and mmcv's) while frozen: keep nothing.

Everything else keeps autograd's default (GroupNorm / LayerNorm, whose
backward needs their input; GELU, Sigmoid, HSwish and other smooth
activations; ``Dropout2d``, whose noise is already one value per channel).
"""
from typing import Dict, Optional, Type

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..ops.lean import (FrozenAffineNormFunction, FrozenConvFunction,
                        FrozenLinearFunction, MaskedActivationFunction,
                        MaskedDropoutFunction,
                        ShapeOnlyAdaptiveAvgPoolFunction, recomputed_losses)
from .gf_conv import GFConv2d, is_filterable_conv, with_mmcv_wrapper
from .lean_loss import chunkable_losses, chunked_cross_entropy_losses

__all__ = [
    'make_lean', 'make_plain', 'is_lean', 'lean_kind', 'frozen_conv_is_lean',
    'LEAN_KINDS'
]

#: What :func:`lean_kind` returns for a module that has a lean variant.
LEAN_KINDS = ('norm', 'activation', 'dropout', 'pool', 'loss',
              'frozen_conv', 'frozen_linear')


def _recording(x: Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class _LeanFrozenNorm:
    """Eval-mode batch norm without trainable parameters: ``g * scale``."""

    def forward(self, x: Tensor) -> Tensor:
        if (not _recording(x) or self.training or self.running_var is None
                or any(p.requires_grad for p in self.parameters())):
            return super().forward(x)
        var = self.running_var.float()
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight.detach().float()
        return FrozenAffineNormFunction.apply(x, scale, super().forward)


class _LeanActivation:
    """ReLU / Hardtanh (ReLU6) / LeakyReLU keeping a bit mask."""

    def forward(self, x: Tensor) -> Tensor:
        # A view modified in place needs autograd's own view bookkeeping.
        if not _recording(x) or (self.inplace and x._is_view()):
            return super().forward(x)
        if isinstance(self, nn.LeakyReLU):
            args = (0.0, None, False, float(self.negative_slope))
        elif isinstance(self, nn.Hardtanh):
            args = (float(self.min_val), float(self.max_val), True, 0.0)
        else:
            args = (0.0, None, True, 0.0)
        return MaskedActivationFunction.apply(x, super().forward, *args,
                                              bool(self.inplace))


class _LeanDropout:
    """Element-wise dropout keeping its keep mask as bits."""

    def forward(self, x: Tensor) -> Tensor:
        if (not self.training or not 0 < self.p < 1 or self.inplace
                or not _recording(x)):
            return super().forward(x)
        return MaskedDropoutFunction.apply(x, float(self.p))


class _LeanAdaptiveAvgPool:
    """Adaptive average pooling keeping its input's shape only."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x) or x.dim() != 4 or x.shape[-2:] == (1, 1) \
                or self._pools_to_one(x):
            return super().forward(x)
        return ShapeOnlyAdaptiveAvgPoolFunction.apply(x, super().forward)

    def _pools_to_one(self, x: Tensor) -> bool:
        size = self.output_size
        size = (size, size) if not isinstance(size, (tuple, list)) else size
        out = [x.shape[-2 + i] if s is None else s for i, s in
               enumerate(size)]
        return tuple(out) == (1, 1)


class _LeanLossHead:
    """A decode head whose loss keeps the low-resolution logits only:
    mmseg's cross-entropy image by image (:mod:`.lean_loss`), any other
    loss on the whole batch, recomputed in the backward."""

    def loss_by_feat(self, seg_logits: Tensor, batch_data_samples) -> dict:
        if not _recording(seg_logits):
            return super().loss_by_feat(seg_logits, batch_data_samples)
        specs = chunkable_losses(self)
        if specs is not None:
            return chunked_cross_entropy_losses(self, seg_logits,
                                                batch_data_samples, specs)
        plain = super().loss_by_feat
        return recomputed_losses(
            lambda logits: plain(logits, batch_data_samples), seg_logits)


def _frozen(*tensors: Optional[Tensor]) -> bool:
    return not any(t is not None and t.requires_grad for t in tensors)


def frozen_conv_is_lean(conv: nn.Module) -> bool:
    """Whether a lean conv keeps nothing when autograd records it with
    frozen weight and bias: zero padding of integer sizes (any other
    padding runs the plain convolution, which keeps its input)."""
    return (isinstance(conv, _LeanFrozenConv) and conv.padding_mode == 'zeros'
            and not isinstance(conv.padding, str))


class _LeanFrozenConv:
    """A conv that keeps nothing while frozen (see
    :class:`~mmseg_gf.ops.lean.FrozenConvFunction`). In ``_conv_forward``,
    as GFConv2d, so callers passing their own weight (mmcv's
    ``efficient_conv_bn_eval``) get it too; trained, it is the plain conv."""

    def _conv_forward(self, x: Tensor, weight: Tensor,
                      bias: Optional[Tensor]) -> Tensor:
        plain = super()._conv_forward
        if (not _recording(x) or not _frozen(weight, bias) or x.dim() != 4
                or x.numel() == 0 or not frozen_conv_is_lean(self)):
            return plain(x, weight, bias)
        return FrozenConvFunction.apply(
            x, weight, lambda t: plain(t, weight, bias), self.stride,
            self.padding, self.dilation, self.groups)


class _LeanFrozenLinear:
    """A linear layer that keeps nothing while frozen."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x) or not _frozen(self.weight, self.bias):
            return super().forward(x)
        return FrozenLinearFunction.apply(x, self.weight, super().forward)


def _plain_type(module: nn.Module) -> type:
    """The class of ``module`` before :func:`make_lean`."""
    return getattr(type(module), '_plain_class', type(module))


_MIXINS = {'norm': _LeanFrozenNorm, 'activation': _LeanActivation,
           'dropout': _LeanDropout, 'pool': _LeanAdaptiveAvgPool,
           'loss': _LeanLossHead, 'frozen_conv': _LeanFrozenConv,
           'frozen_linear': _LeanFrozenLinear}
_CLASSES: Dict[Type[nn.Module], Type[nn.Module]] = {}


def _base_decode_head_loss():
    try:
        from mmseg.models.decode_heads.decode_head import BaseDecodeHead
    except ImportError:
        return None
    return BaseDecodeHead.loss_by_feat


def lean_kind(module: nn.Module) -> Optional[str]:
    """Which lean variant ``module`` has (one of :data:`LEAN_KINDS`), or
    None. Already-lean modules report their kind too."""
    if isinstance(module, _BatchNorm):
        return 'norm'
    if type(module) in (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU) or (
            is_lean(module) and isinstance(module, _LeanActivation)):
        return 'activation'
    if type(module) is nn.Dropout or isinstance(module, _LeanDropout):
        return 'dropout'
    if isinstance(module, nn.AdaptiveAvgPool2d):
        return 'pool'
    if is_filterable_conv(module) and not isinstance(module, GFConv2d):
        return 'frozen_conv'
    if _plain_type(module) in with_mmcv_wrapper(nn.Linear):
        return 'frozen_linear'
    base_loss = _base_decode_head_loss()
    if base_loss is not None and getattr(
            _plain_type(module), 'loss_by_feat', None) is base_loss:
        return 'loss'
    return None


def is_lean(module: nn.Module) -> bool:
    """True if :func:`make_lean` swapped ``module``'s class."""
    return '_plain_class' in type(module).__dict__


def _lean_class(cls: Type[nn.Module], kind: str) -> Type[nn.Module]:
    lean = _CLASSES.get(cls)
    if lean is None:
        lean = type(f'Lean{cls.__name__}', (_MIXINS[kind], cls),
                    {'_plain_class': cls, '__module__': cls.__module__})
        _CLASSES[cls] = lean
    return lean


def make_lean(module: nn.Module) -> Optional[str]:
    """Swap ``module`` (not its children) to its lean variant, if it has one.

    Returns:
        The kind swapped (or already lean), None if it has no lean variant.
    """
    kind = lean_kind(module)
    if kind is not None and not is_lean(module):
        module.__class__ = _lean_class(type(module), kind)
    return kind


def make_plain(module: nn.Module) -> bool:
    """Undo :func:`make_lean` on ``module``; returns whether it was lean."""
    if not is_lean(module):
        return False
    module.__class__ = type(module).__dict__['_plain_class']
    return True
