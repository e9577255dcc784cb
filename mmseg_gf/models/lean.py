"""Lean variants of the modules around a trained conv (:mod:`mmseg_gf.ops.lean.functions`).

:func:`make_lean` swaps a module's class for a subclass of its own class, so
``isinstance``, ``state_dict`` keys, hooks and forward numbers are
unchanged; :func:`make_plain` swaps it back. A lean module runs its plain
forward unless autograd records it, so swapping every module costs nothing
outside the trained region. What becomes lean and what each keeps:
docs/lean_region.md, "What each layer keeps"."""
import functools
from typing import Callable, Optional, Set, Type

import torch
import torch.nn.functional as F
from mmengine.logging import print_log
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..ops.bit_mask import masks as bit_mask
from ..ops.backend import dispatch
from ..ops.lean.functions import (FrozenAffineNormFunction, FrozenConvFunction,
                                  FrozenLinearFunction,
                                  MaskedActivationFunction,
                                  MaskedDropoutFunction,
                                  ShapeOnlyAdaptiveAvgPoolFunction)
from ..ops.function_output import AliasedOutputError
from ..ops.lean.activation import (HARDSIGMOID_SLOPE,
                                   PiecewiseLinearActivationFunction,
                                   clamp_bits, hardsigmoid_bits)
from ..ops.lean.pool import (MAX_WINDOW, ShapeOnlyAvgPoolFunction,
                             WindowOffsetMaxPoolFunction)
from ..patching import is_swapped, plain_class, swap_class, unswap_class
from ..ops.resize.bilinear import (strided_gradient_resizes,
                                   traced_rule_applies)
from ..ops.frozen_norm.gpu import FrozenBatchNormFunction
from ..ops.resized_loss.loss import LabelRangeError
from .conv_block import conv_block_mixin
from .head_resizes import routed_resizes
from .gf_conv import with_mmcv_wrapper
from .layer_kinds import traced_kind_of
from .lean_transformer import (KIND_MIXINS, TRANSFORMER_KINDS,
                               mmcv_dropout_class, transformer_kind,
                               transformer_mixin)
from .patch_mean_gelu import LEAN_OWNER, is_patch_mean_gelu
from .trained import trains
from .lean_head import (ClassifierCapture, base_decode_head,
                        disable_classifier_fusion, fused_classifier_losses,
                        fusion_blocker, lean_head_losses, log_fallback_once,
                        traced_head_losses)

try:
    from mmcv.cnn.bricks.hsigmoid import HSigmoid
except ImportError:  # no mmcv: torch's own kinds only
    HSigmoid = None

__all__ = [
    'make_lean', 'make_plain', 'is_lean', 'lean_kind', 'frozen_conv_is_lean',
    'lean_or_plain', 'LEAN_KINDS'
]

#: What :func:`lean_kind` returns for a module that has a lean variant.
LEAN_KINDS = ('norm', 'activation', 'dropout', 'pool', 'loss',
              'frozen_conv', 'frozen_linear') + TRANSFORMER_KINDS + (
                  'patch_mean_gelu', 'conv_block')


def _recording(x: Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


_FALLBACKS_LOGGED: Set[str] = set()


def lean_or_plain(module: nn.Module, lean: Callable[[], Tensor],
                  plain: Callable[[], Tensor]) -> Tensor:
    """``lean()``, or ``plain()`` for good where the lean Function cannot give
    its output as a tensor of its own (an in-place use downstream would
    corrupt a view of its input). Logged once per module class; the plain
    forward computes the same numbers."""
    if module.__dict__.get('_gf_lean_off') is not None:
        return plain()
    if torch.compiler.is_compiling():
        return lean()
    try:
        return lean()
    except AliasedOutputError as error:
        module._gf_lean_off = str(error)
        name = type(module).__name__
        if name not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(name)
            print_log(f'lean: {name} runs its plain forward (autograd keeps '
                      f'what it keeps): {error}', logger='current')
        return plain()


class _LeanFrozenNorm:
    """Eval-mode batch norm without trainable parameters: ``g * scale``."""

    def frozen_affine(self) -> Optional[tuple]:
        """``(running_mean, running_var, weight, bias, eps)`` while frozen
        (eval mode, nothing trained), else None."""
        if (self.training or self.running_var is None
                or self.running_mean is None or trains(self)):
            return None
        return (self.running_mean, self.running_var, self.weight, self.bias,
                float(self.eps))

    def forward(self, x: Tensor) -> Tensor:
        if (not _recording(x) or self.training or self.running_var is None
                or trains(self)):
            return super().forward(x)
        plain = super().forward
        # the factor is taken in the backward
        if dispatch.choose('frozen_norm', x).implementation.name == 'triton':
            return lean_or_plain(self, lambda: FrozenBatchNormFunction.apply(
                x, self.running_var, self.weight, float(self.eps), plain),
                lambda: plain(x))
        # the factor in the accumulation dtype: float32, float64 for a
        # float64 norm (whose backward is then batch norm's own two products)
        acc = torch.promote_types(self.running_var.dtype, torch.float32)
        scale = torch.rsqrt(self.running_var.to(acc) + self.eps)
        if acc == torch.float64 and x.dtype == torch.float64:
            return lean_or_plain(self, lambda: FrozenAffineNormFunction.apply(
                x, scale, plain, self.weight), lambda: plain(x))
        if self.weight is not None:
            scale = scale * self.weight.detach().to(acc)
        return lean_or_plain(
            self, lambda: FrozenAffineNormFunction.apply(x, scale, plain),
            lambda: plain(x))


class _LeanActivation:
    """ReLU / Hardtanh (ReLU6) / LeakyReLU keeping a bit mask."""

    def forward(self, x: Tensor) -> Tensor:
        # A view modified in place needs autograd's own view bookkeeping
        # (a view has a _base: what _is_view() says, in a form Dynamo traces).
        if torch.compiler.is_compiling() and self.inplace:
            # traced: out of place, so that no graph input is mutated
            # (CUDA graphs skip a graph that mutates one)
            return self._out_of_place(x)
        if not _recording(x) or (self.inplace and x._base is not None):
            return super().forward(x)
        formula, *args = self.mask_arguments()
        plain = super().forward
        # formula: on the Triton path the output and the mask in one pass
        return lean_or_plain(self, lambda: MaskedActivationFunction.apply(
            x, plain, *args, bool(self.inplace), formula), lambda: plain(x))

    def _out_of_place(self, x: Tensor) -> Tensor:
        """The activation of ``x`` into a new tensor, lean where recorded:
        the same numbers as the in-place call."""
        formula, lo, hi, nan_bit, off_scale = self.mask_arguments()
        if formula == 'scale':
            activate = functools.partial(F.leaky_relu,
                                         negative_slope=off_scale)
        elif hi is None:
            activate = F.relu
        else:
            activate = functools.partial(F.hardtanh, min_val=lo, max_val=hi)
        if not _recording(x):
            return activate(x)
        return MaskedActivationFunction.apply(x, activate, lo, hi, nan_bit,
                                              off_scale, False, formula)

    def mask_arguments(self) -> tuple:
        """``(formula, lo, hi, nan_bit, off_scale)``: its formula and mask
        (:class:`~mmseg_gf.ops.lean.functions.MaskedActivationFunction`)."""
        if isinstance(self, nn.LeakyReLU):
            return 'scale', 0.0, None, False, float(self.negative_slope)
        if isinstance(self, nn.Hardtanh):
            return ('clamp', float(self.min_val), float(self.max_val), True,
                    0.0)
        return 'clamp', 0.0, None, True, 0.0


class _LeanHardsigmoid:
    """torch's Hardsigmoid keeping 1 bit: ``-3 < x < 3``; the passing
    gradient times 1/6, as ``hardsigmoid_backward``."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x) or (self.inplace and x._base is not None):
            return super().forward(x)
        plain = super().forward
        return lean_or_plain(self, lambda: PiecewiseLinearActivationFunction
                             .apply(x, plain, hardsigmoid_bits, None,
                                    _times_one_sixth, bool(self.inplace)),
                             lambda: plain(x))


def _times_one_sixth(g: Tensor) -> Tensor:
    return g * HARDSIGMOID_SLOPE


class _LeanHSigmoid:
    """mmcv's ``HSigmoid`` keeping 1 bit: whether ``(x + bias) / divisor`` is
    inside clamp's inclusive bounds."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x):
            return super().forward(x)
        plain = super().forward
        return lean_or_plain(self, lambda: PiecewiseLinearActivationFunction
                             .apply(x, plain, self._bits, None,
                                    self._divide, False), lambda: plain(x))

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
        plain = super().forward
        return lean_or_plain(self, lambda: PiecewiseLinearActivationFunction
                             .apply(x, plain, _positive_bits, self.weight,
                                    None, False), lambda: plain(x))


def _positive_bits(x: Tensor) -> Tensor:
    return bit_mask.pack(x, 0.0, None, False)


class _LeanMaxPool:
    """``MaxPool2d`` keeping a uint8 window offset per output element and
    its input's shape (:mod:`mmseg_gf.ops.lean.pool`)."""

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
        plain = super().forward
        return lean_or_plain(
            self, lambda: ShapeOnlyAdaptiveAvgPoolFunction.apply(x, plain),
            lambda: plain(x))

    def _pools_to_one(self, x: Tensor) -> bool:
        size = self.output_size
        size = (size, size) if not isinstance(size, (tuple, list)) else size
        out = [x.shape[-2 + i] if s is None else s for i, s in
               enumerate(size)]
        return tuple(out) == (1, 1)


def _traced_resize_rule(inputs) -> bool:
    """Whether a traced head's resizes of ``inputs`` (its feature maps)
    take :func:`~mmseg_gf.ops.resize.bilinear.traced_rule_applies`."""
    tensors = inputs if isinstance(inputs, (tuple, list)) else [inputs]
    return any(isinstance(t, Tensor) and traced_rule_applies(t)
               for t in tensors)


def _recording_any(logits) -> bool:
    tensors = logits if isinstance(logits, (tuple, list)) else [logits]
    return all(isinstance(t, Tensor) for t in tensors) and any(
        _recording(t) for t in tensors)


class _LeanLossHead:
    """A decode head whose loss keeps neither the upsampled logits nor, fused,
    the classifier's input (:mod:`.lean_head`)."""

    def loss(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            # traced: no classifier capture; the resizes' rule on CPU
            # tensors only (ops.resize.bilinear.traced_rule_applies), no
            # torch function mode in a graph on CUDA's path
            if not _traced_resize_rule(args[0] if args else None):
                return super().loss(*args, **kwargs)
            with strided_gradient_resizes():
                return super().loss(*args, **kwargs)
        # its bilinear resizes read a concatenation's channel slice of
        # their gradient in place (ops.resize), F.interpolate alone routed
        with routed_resizes():
            if fusion_blocker(self) is not None:
                return super().loss(*args, **kwargs)
            self._gf_classifier_capture = ClassifierCapture()
            try:
                return super().loss(*args, **kwargs)
            finally:
                self._gf_classifier_capture = None

    def cls_seg(self, feat: Tensor) -> Tensor:
        capture = getattr(self, '_gf_classifier_capture', None)
        if capture is None:
            return super().cls_seg(feat)
        return capture.classify(self, feat)

    def loss_by_feat(self, seg_logits, batch_data_samples, *args, **kwargs):
        if args or kwargs or not _recording_any(seg_logits) or getattr(
                self, '_gf_lean_loss_off', None):
            return super().loss_by_feat(seg_logits, batch_data_samples,
                                        *args, **kwargs)
        if torch.compiler.is_compiling():
            return traced_head_losses(self, seg_logits, batch_data_samples)
        capture = getattr(self, '_gf_classifier_capture', None)
        reason = None if capture is None else capture.mismatch(seg_logits)
        rng = torch.get_rng_state()
        try:
            if capture is not None and reason is None:
                return fused_classifier_losses(self, capture, seg_logits,
                                               batch_data_samples)
            if reason is not None:
                disable_classifier_fusion(self, reason)
            return lean_head_losses(self, seg_logits, batch_data_samples)
        except LabelRangeError:
            # Bad data, not a property of the head: this batch runs mmseg's
            # own loss (its error, or what it does with such labels), the
            # next batch the lean loss again.
            torch.set_rng_state(rng)
            return super().loss_by_feat(seg_logits, batch_data_samples)
        except ValueError as error:  # this loss needs autograd's own path
            self._gf_lean_loss_off = self._gf_fused_classifier_off = str(error)
            log_fallback_once(self, str(error))
            torch.set_rng_state(rng)  # the plain loss draws what it drew
        return super().loss_by_feat(seg_logits, batch_data_samples)


def _frozen(*tensors: Optional[Tensor]) -> bool:
    return not any(t is not None and t.requires_grad for t in tensors)


def frozen_conv_is_lean(conv: nn.Module) -> bool:
    """Whether a frozen lean conv keeps nothing: zero padding of integer sizes
    (other padding runs the plain conv)."""
    return (isinstance(conv, _LeanFrozenConv) and conv.padding_mode == 'zeros'
            and not isinstance(conv.padding, str))


class _LeanFrozenConv:
    """A conv that keeps nothing while frozen; in ``_conv_forward``, so callers
    passing their own weight (mmcv's ``efficient_conv_bn_eval``) get it too."""

    def _conv_forward(self, x: Tensor, weight: Tensor,
                      bias: Optional[Tensor]) -> Tensor:
        plain = super()._conv_forward
        if (not _recording(x) or not _frozen(weight, bias) or x.dim() != 4
                or x.numel() == 0 or not frozen_conv_is_lean(self)):
            return plain(x, weight, bias)
        return lean_or_plain(self, lambda: FrozenConvFunction.apply(
            x, weight, lambda t: plain(t, weight, bias), self.stride,
            self.padding, self.dilation, self.groups),
            lambda: plain(x, weight, bias))


class _LeanFrozenLinear:
    """A linear layer that keeps nothing while frozen."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x) or not _frozen(self.weight, self.bias):
            return super().forward(x)
        plain = super().forward
        return lean_or_plain(
            self, lambda: FrozenLinearFunction.apply(x, self.weight, plain),
            lambda: plain(x))


_MIXINS = {'norm': _LeanFrozenNorm, 'activation': _LeanActivation,
           'dropout': _LeanDropout, 'pool': _LeanAdaptiveAvgPool,
           'loss': _LeanLossHead, 'frozen_conv': _LeanFrozenConv,
           'frozen_linear': _LeanFrozenLinear, **KIND_MIXINS}
#: Lean variants chosen by class rather than by kind.
_CLASS_MIXINS = {nn.Hardsigmoid: _LeanHardsigmoid, nn.PReLU: _LeanPReLU,
                 nn.MaxPool2d: _LeanMaxPool, nn.AvgPool2d: _LeanAvgPool}
if HSigmoid is not None:
    _CLASS_MIXINS[HSigmoid] = _LeanHSigmoid
_POOLS = (nn.MaxPool2d, nn.AvgPool2d)


def lean_kind(module: nn.Module) -> Optional[str]:
    """Which lean variant ``module`` has (one of :data:`LEAN_KINDS`), or
    None. Already-lean modules report their kind too."""
    if isinstance(module, _BatchNorm):
        return 'norm'
    if is_patch_mean_gelu(module):
        # installed by the engine where the trace shows it exact, never
        # by make_lean
        return 'patch_mean_gelu'
    if type(module) in (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU) or (
            is_lean(module) and isinstance(module, _LeanActivation)):
        return 'activation'
    plain = plain_class(module)
    if plain in _CLASS_MIXINS:
        return 'pool' if plain in _POOLS else 'activation'
    if plain in (nn.Dropout, mmcv_dropout_class()):
        return 'dropout'
    kind = transformer_kind(plain)
    if kind is not None:
        return kind
    if isinstance(module, nn.AdaptiveAvgPool2d):
        return 'pool'
    if conv_block_mixin(plain) is not None:
        return 'conv_block'
    frozen = _frozen_layer_kind(module)
    if frozen is not None:
        return frozen
    base = base_decode_head()
    if base is not None and isinstance(module, base):
        return 'loss'
    return None


def _frozen_layer_kind(module: nn.Module) -> Optional[str]:
    """The frozen lean variant ``module``'s layer kind gives it, or None (a
    filtered module, or a subclass with its own forward)."""
    kind = traced_kind_of(module)
    if kind is None or kind.frozen_lean is None:
        return None
    if plain_class(module) in with_mmcv_wrapper(kind.traced_type):
        return kind.frozen_lean
    return None


def is_lean(module: nn.Module) -> bool:
    """True if ``module``'s class was swapped to a lean variant."""
    return is_swapped(module, LEAN_OWNER)


def _lean_mixin(cls: Type[nn.Module], kind: str) -> type:
    return (_CLASS_MIXINS.get(cls) or transformer_mixin(cls)
            or conv_block_mixin(cls) or _MIXINS[kind])


def make_lean(module: nn.Module) -> Optional[str]:
    """Swap ``module`` (not its children) to its lean variant, if it has one.

    Returns:
        The kind swapped (or already lean), None if it has no lean variant.
    """
    kind = lean_kind(module)
    if kind is not None and not is_lean(module):
        cls = type(module)
        swap_class(module, _lean_mixin(cls, kind), LEAN_OWNER,
                   f'Lean{cls.__name__}')
    return kind


def make_plain(module: nn.Module) -> bool:
    """Undo :func:`make_lean` on ``module``; returns whether it was lean."""
    return unswap_class(module, LEAN_OWNER)
