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
* ``ReLU``, ``ReLU6`` / ``Hardtanh``, ``LeakyReLU``, ``Hardsigmoid``,
  mmcv's ``HSigmoid``, ``PReLU`` with a frozen slope: keep 1 bit per element.
* ``MaxPool2d``: keeps a uint8 window offset per output element;
  ``AvgPool2d`` (4-D): its input's shape only.
* ``Dropout`` (element-wise): keeps 1 bit per element.
* ``AdaptiveAvgPool2d`` to more than 1x1 (PSPNet's pyramid): keeps the
  input's shape only.
* decode heads whose loss is mmseg's ``BaseDecodeHead.loss_by_feat``: keep
  the low-resolution logits, not the upsampled ones
  (:func:`make_lean` on the head).

Everything else keeps autograd's default (GroupNorm / LayerNorm, whose
backward needs their input; GELU, Sigmoid, HSwish and other smooth
activations, a trained PReLU; ``Dropout2d``, whose noise is already one
value per channel).
"""
from typing import Dict, Optional, Type

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..ops import bit_mask
from ..ops.lean import (FrozenAffineNormFunction, MaskedActivationFunction,
                        MaskedDropoutFunction,
                        ShapeOnlyAdaptiveAvgPoolFunction, recomputed_losses)
from ..ops.lean_activation import (HARDSIGMOID_SLOPE,
                                   PiecewiseLinearActivationFunction,
                                   clamp_bits, hardsigmoid_bits)
from ..ops.lean_pool import (MAX_WINDOW, ShapeOnlyAvgPoolFunction,
                             WindowOffsetMaxPoolFunction)
from .lean_loss import chunkable_losses, chunked_cross_entropy_losses

try:
    from mmcv.cnn.bricks.hsigmoid import HSigmoid
except ImportError:  # no mmcv: torch's own kinds only
    HSigmoid = None

__all__ = [
    'make_lean', 'make_plain', 'is_lean', 'lean_kind',
    'LEAN_KINDS'
]

#: What :func:`lean_kind` returns for a module that has a lean variant.
LEAN_KINDS = ('norm', 'activation', 'dropout', 'pool', 'loss')


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


class _LeanHardsigmoid:
    """torch's Hardsigmoid keeping 1 bit: ``-3 < x < 3``; the passing
    gradient times 1/6, as ``hardsigmoid_backward``."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x) or (self.inplace and x._is_view()):
            return super().forward(x)
        return PiecewiseLinearActivationFunction.apply(
            x, super().forward, hardsigmoid_bits, None, _times_one_sixth,
            bool(self.inplace))


def _times_one_sixth(g: Tensor) -> Tensor:
    return g * HARDSIGMOID_SLOPE


class _LeanHSigmoid:
    """mmcv's ``HSigmoid``, ``clamp((x + bias) / divisor, min, max)``,
    keeping 1 bit: ``min <= (x + bias) / divisor <= max`` (clamp's
    inclusive bounds); the passing gradient divided by ``divisor``, as the
    chain of clamp's and division's backward computes it."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x):
            return super().forward(x)
        return PiecewiseLinearActivationFunction.apply(
            x, super().forward, self._bits, None, self._divide, False)

    def _bits(self, x: Tensor) -> Tensor:
        # the value mmcv clamps, computed by the same operations
        return clamp_bits((x + self.bias) / self.divisor,
                          float(self.min_value), float(self.max_value))

    def _divide(self, g: Tensor) -> Tensor:
        return g / self.divisor


class _LeanPReLU:
    """PReLU with a frozen slope keeping 1 bit: ``x > 0``; elsewhere the
    gradient times the slope Parameter (kept itself, alive anyway)."""

    def forward(self, x: Tensor) -> Tensor:
        if (not _recording(x) or self.weight.requires_grad or x.dim() < 2
                or self.weight.numel() not in (1, x.shape[1])):
            return super().forward(x)
        return PiecewiseLinearActivationFunction.apply(
            x, super().forward, _positive_bits, self.weight, None, False)


def _positive_bits(x: Tensor) -> Tensor:
    return bit_mask.pack(x, 0.0, None, False)


class _LeanMaxPool:
    """``MaxPool2d`` keeping a uint8 window offset per output element and
    its input's shape (:mod:`mmseg_gf.ops.lean_pool`)."""

    def keeps_offsets(self, x: Tensor) -> bool:
        """Whether a recorded call on ``x`` runs the lean path."""
        kernel = _pair(self.kernel_size)
        return (x.dim() == 4 and x.is_contiguous() and not
                self.return_indices and kernel[0] * kernel[1] <= MAX_WINDOW)

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x) or not self.keeps_offsets(x):
            return super().forward(x)
        stride = self.stride if self.stride else self.kernel_size
        return WindowOffsetMaxPoolFunction.apply(
            x, _pair(self.kernel_size), _pair(stride), _pair(self.padding),
            _pair(self.dilation), bool(self.ceil_mode))


class _LeanAvgPool:
    """``AvgPool2d`` keeping its input's shape only (its backward is
    linear)."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x) or x.dim() != 4:
            return super().forward(x)
        stride = self.stride if self.stride else self.kernel_size
        return ShapeOnlyAvgPoolFunction.apply(
            x, _pair(self.kernel_size), _pair(stride), _pair(self.padding),
            bool(self.ceil_mode), bool(self.count_include_pad),
            self.divisor_override)


def _pair(v) -> tuple:
    return tuple(int(i) for i in v) if isinstance(v, (tuple, list)) else (
        int(v), int(v))


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


_MIXINS = {'norm': _LeanFrozenNorm, 'activation': _LeanActivation,
           'dropout': _LeanDropout, 'pool': _LeanAdaptiveAvgPool,
           'loss': _LeanLossHead}
_CLASSES: Dict[Type[nn.Module], Type[nn.Module]] = {}
#: Lean variants chosen by class rather than by kind.
_CLASS_MIXINS = {nn.Hardsigmoid: _LeanHardsigmoid, nn.PReLU: _LeanPReLU,
                 nn.MaxPool2d: _LeanMaxPool, nn.AvgPool2d: _LeanAvgPool}
if HSigmoid is not None:
    _CLASS_MIXINS[HSigmoid] = _LeanHSigmoid
_POOLS = (nn.MaxPool2d, nn.AvgPool2d)


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
    plain = getattr(type(module), '_plain_class', type(module))
    if plain in _CLASS_MIXINS:
        return 'pool' if plain in _POOLS else 'activation'
    if type(module) is nn.Dropout or isinstance(module, _LeanDropout):
        return 'dropout'
    if isinstance(module, nn.AdaptiveAvgPool2d):
        return 'pool'
    base_loss = _base_decode_head_loss()
    if base_loss is not None and getattr(
            getattr(type(module), '_plain_class', type(module)),
            'loss_by_feat', None) is base_loss:
        return 'loss'
    return None


def is_lean(module: nn.Module) -> bool:
    """True if :func:`make_lean` swapped ``module``'s class."""
    return '_plain_class' in type(module).__dict__


def _lean_class(cls: Type[nn.Module], kind: str) -> Type[nn.Module]:
    lean = _CLASSES.get(cls)
    if lean is None:
        mixin = _CLASS_MIXINS.get(cls, _MIXINS[kind])
        lean = type(f'Lean{cls.__name__}', (mixin, cls),
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
