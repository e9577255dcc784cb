"""A head's classifier fused with its loss, whose gradient is taken in the
forward (:mod:`.loss_gradients`).

For logits ``z = conv(x, W, b)``, :class:`FusedClassifierLossFunction` takes
``g_W`` and ``g_b`` from ``x`` in the forward, so it keeps ``g_z`` per loss
gradient instead of ``x`` and the logits; its backward is ``g_x = W^T g_z``.
A ``Dropout2d`` before a 1x1 classifier folds into the weight,
``conv(x * s_n, W) = (W * s_n) x`` per image
(:func:`channel_scaled_classifier`), so the dropped-out copy of ``x`` is
never made. No mmseg import (:mod:`mmseg_gf.models.lean` wires the heads).
"""
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd import Function

from .scaling import (basis_scales, flatten_gradients, function_outputs,
                      recombine_gradients, scaled_sum)
from ..lean.kept_sources import note_sources
from .gradients import LogitGradients
from ..backend.output_pool import empty_for_writing

__all__ = ['ConvSpec', 'FusedClassifierLossFunction',
           'channel_scaled_classifier', 'is_pointwise',
           'weight_and_bias_gradients', 'input_gradient']


@dataclass(frozen=True)
class ConvSpec:
    """A 2-d convolution's settings (as ``torch.nn.Conv2d`` holds them)."""

    stride: Tuple[int, int] = (1, 1)
    padding: Tuple[int, int] = (0, 0)
    dilation: Tuple[int, int] = (1, 1)
    groups: int = 1

    @classmethod
    def of(cls, conv: torch.nn.Conv2d) -> 'ConvSpec':
        return cls(tuple(conv.stride), tuple(conv.padding),
                   tuple(conv.dilation), int(conv.groups))


def is_pointwise(weight: Tensor, spec: ConvSpec) -> bool:
    """A 1x1 convolution, stride 1, no padding, one group (a classifier)."""
    return (tuple(weight.shape[2:]) == (1, 1) and spec.stride == (1, 1)
            and spec.padding == (0, 0) and spec.groups == 1)


def _pixels_by_channels(t: Tensor) -> Tensor:
    n, c = t.shape[:2]
    return t.permute(0, 2, 3, 1).reshape(n, -1, c)


def _per_image_weights(weight: Tensor, channel_scale: Optional[Tensor],
                       n: int) -> Tensor:
    """A 1x1 conv's ``K x C`` matrix, per image with its input channels scaled
    by ``channel_scale`` (``N x C``), if given.
    """
    k, c = weight.shape[:2]
    w = weight.reshape(1, k, c)
    if channel_scale is None:
        return w.expand(n, k, c)
    return w * channel_scale.reshape(n, 1, c).to(weight.dtype)


def channel_scaled_classifier(x: Tensor, weight: Tensor,
                              bias: Optional[Tensor],
                              channel_scale: Tensor) -> Tensor:
    """``conv2d(x * channel_scale, W, b)`` of a 1x1 classifier as ``(W * s_n)
    x_n + b`` per image, without making ``x * channel_scale``.

    Differentiable by autograd; the output keeps ``x``'s layout.

    Args:
        x: ``N x C x H x W``.
        weight: ``K x C x 1 x 1``.
        bias: ``K`` or None.
        channel_scale: ``N x C`` (or ``N x C x 1 x 1``), e.g. a training
            ``Dropout2d``'s noise.
    """
    n, c, h, w = x.shape
    k = weight.shape[0]
    mats = _per_image_weights(weight, channel_scale, n)
    if _memory_format(x) is torch.channels_last:
        rows = _pixels_by_channels(x)
        out = torch.bmm(rows, mats.transpose(1, 2)) if bias is None else \
            torch.baddbmm(bias.reshape(1, 1, k), rows, mats.transpose(1, 2))
        return out.view(n, h, w, k).permute(0, 3, 1, 2)
    planes = x.reshape(n, c, h * w)
    out = torch.bmm(mats, planes) if bias is None else \
        torch.baddbmm(bias.reshape(1, k, 1), mats, planes)
    return out.view(n, k, h, w)


def weight_and_bias_gradients(x: Tensor, weight: Tensor, g_z: Tensor,
                              spec: ConvSpec, bias: bool,
                              channel_scale: Optional[Tensor] = None
                              ) -> Tuple[Tensor, Optional[Tensor]]:
    """``g_W`` and ``g_b`` of ``z = conv2d(x * channel_scale, W, b)`` in
    ``g_z``'s dtype: a batched matrix product reading ``x`` in its own layout
    for a 1x1 classifier (autograd copies a channels-last ``x``), else
    autograd's ``convolution_backward``.
    """
    x, weight = x.to(g_z.dtype), weight.to(g_z.dtype)
    if is_pointwise(weight, spec) and x.shape[2:] == g_z.shape[2:]:
        n, k, c = x.shape[0], weight.shape[0], weight.shape[1]
        g = g_z.reshape(n, k, -1)
        if _memory_format(x) is torch.channels_last:
            g_w = torch.bmm(g, _pixels_by_channels(x))
        else:
            g_w = torch.bmm(g, x.reshape(n, c, -1).transpose(1, 2))
        if channel_scale is not None:
            g_w = g_w * channel_scale.reshape(n, 1, c).to(g_w.dtype)
        g_b = g_z.sum((0, 2, 3)) if bias else None
        return g_w.sum(0).view(k, c, 1, 1), g_b
    if channel_scale is not None:
        raise ValueError('a channel scale folds into a 1x1 classifier only')
    _, g_w, g_b = torch.ops.aten.convolution_backward(
        g_z, x, weight, [weight.shape[0]] if bias else None,
        list(spec.stride), list(spec.padding), list(spec.dilation), False,
        [0, 0], spec.groups, [False, True, bias])
    return g_w, g_b


def _memory_format(x: Tensor) -> torch.memory_format:
    if not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def input_gradient(g_z: Tensor, weight: Tensor, shape: Sequence[int],
                   spec: ConvSpec,
                   layout: torch.memory_format = torch.contiguous_format,
                   channel_scale: Optional[Tensor] = None) -> Tensor:
    """``g_x = W^T g_z`` of ``z = conv2d(x * channel_scale, W)``, stored in
    ``layout``: one matrix product per image for a 1x1 classifier (the
    transposed convolution copies ``x``'s stand-in to full size:
    docs/benchmarks/design_measurements.md), else
    ``torch.nn.grad.conv2d_input``.
    """
    if is_pointwise(weight, spec) and tuple(shape[2:]) == tuple(g_z.shape[2:]):
        n, k, c = shape[0], weight.shape[0], weight.shape[1]
        g = g_z.reshape(n, k, -1)
        mats = _per_image_weights(weight, channel_scale, n)
        # One product per image, written in place: torch.matmul of a
        # matrix and a batch transposes its result into a copy.
        # (in recycled memory on CPU: no page faults of a fresh map)
        if layout is torch.channels_last:
            out = empty_for_writing((n, shape[2], shape[3], c), g_z)
            rows = out.view(n, -1, c)
            for i in range(n):
                torch.mm(g[i].t(), mats[i], out=rows[i])
            return out.permute(0, 3, 1, 2)
        out = empty_for_writing((n, c, shape[2], shape[3]), g_z)
        planes = out.view(n, c, -1)
        for i in range(n):
            torch.mm(mats[i].t(), g[i], out=planes[i])
        return out
    if channel_scale is not None:
        raise ValueError('a channel scale folds into a 1x1 classifier only')
    extra = []
    for i in range(2):
        reach = (g_z.shape[2 + i] - 1) * spec.stride[i] - \
            2 * spec.padding[i] + spec.dilation[i] * \
            (weight.shape[2 + i] - 1) + 1
        extra.append(shape[2 + i] - reach)
    g_x = torch.nn.functional.conv_transpose2d(
        g_z, weight, None, spec.stride, spec.padding, extra, spec.groups,
        spec.dilation)
    return g_x.contiguous(memory_format=layout)


class FusedClassifierLossFunction(Function):
    """``loss(conv2d(x * s, W, b), *others)`` with every gradient taken in the
    forward.

    Inputs: ``x``, ``weight``, ``bias`` (or None), the detached logits ``z``,
    ``channel_scale`` ``s`` (``N x C`` or None), the :class:`ConvSpec`,
    ``gradients`` (``(z, *others)`` -> :class:`LogitGradients`), ``keys``
    (receives the output keys), then the further tensors the loss reads. Keeps
    ``g_z`` per basis (when ``x`` needs a gradient), ``g_W`` and ``g_b`` (when
    the classifier trains) and the gradients of ``others``: never ``x``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                z: Tensor, channel_scale: Optional[Tensor], spec: ConvSpec,
                gradients: Callable[..., LogitGradients], keys: List[str],
                *others: Tensor):
        result = gradients(z, *others)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        kept_z, kept_w, kept_b = [], [], []
        for basis in result.bases:
            if need_w or need_b:
                g_w, g_b = weight_and_bias_gradients(
                    x, weight, basis, spec, bias is not None, channel_scale)
                kept_w.extend([g_w] if need_w else [])
                kept_b.extend([g_b] if need_b else [])
            kept_z.extend([basis] if need_x else [])
        kept_s = [channel_scale] if need_x and kept_z and \
            channel_scale is not None else []
        keys.extend(result.values)
        ctx.keys = list(result.values)
        ctx.layout, kept_o = flatten_gradients(result.others, ctx.keys)
        note_sources(kept_z + kept_s + kept_w + kept_b + kept_o,
                     [x] * (len(kept_z) + len(kept_s)) +
                     [weight] * len(kept_w) + [bias] * len(kept_b) +
                     [others[j] for _, j in ctx.layout])
        ctx.save_for_backward(weight, *kept_s, *kept_z, *kept_w, *kept_b,
                              *kept_o)
        ctx.counts = (len(kept_s), len(kept_z), len(kept_w), len(kept_b),
                      len(others))
        ctx.x_geometry = (tuple(x.shape), x.dtype, _memory_format(x))
        ctx.spec, ctx.mix = spec, result.mix
        differentiable = set(result.mix) | {
            k for k, gs in result.others.items()
            if any(g is not None for g in gs)}
        return function_outputs(ctx, result.values, differentiable,
                                (x, weight, bias, z, channel_scale, *others))

    @staticmethod
    def backward(ctx, *grad_outputs):
        weight, *kept = ctx.saved_tensors
        n_s, n_z, n_w, n_b, n_o = ctx.counts
        scale, kept = (kept[0] if n_s else None), kept[n_s:]
        kept_z, kept_w = kept[:n_z], kept[n_z:n_z + n_w]
        kept_b, kept_o = kept[n_z + n_w:n_z + n_w + n_b], \
            kept[n_z + n_w + n_b:]
        others = recombine_gradients(ctx.layout, kept_o, grad_outputs, n_o)
        scales = basis_scales(ctx.keys, ctx.mix, grad_outputs)
        g_x = g_w = g_b = None
        if scales and kept_z:
            g_z = scaled_sum([(s, kept_z[b]) for b, s in scales.items()],
                             kept_z[0])
            shape, dtype, layout = ctx.x_geometry
            g_x = input_gradient(g_z, weight.to(g_z.dtype), shape,
                                 ctx.spec, layout, scale).to(dtype)
        if scales and kept_w:
            g_w = scaled_sum([(s, kept_w[b]) for b, s in scales.items()],
                             weight)
        if scales and kept_b:
            g_b = scaled_sum([(s, kept_b[b]) for b, s in scales.items()],
                             weight)
        return (g_x, g_w, g_b, None, None, None, None, None) + others
