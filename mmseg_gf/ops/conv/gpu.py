"""The GPU path of the usual filtered conv: Triton kernels as torch ops.

A conv whose kernel collapses on both axes, on a contiguous NCHW or
channels-last CUDA input, is :class:`TritonFilteredConv2d`: ``F.conv2d``
plus one pass over ``x`` for its patch sums; its backward is one pass over
``g_y`` and one launch of :mod:`.products_kernels`
(``MMSEG_GF_FUSED_PRODUCTS=0``: cuBLAS GEMMs and a spread). Both are
``torch.library`` ops with fake implementations, so ``torch.compile``
traces them and CUDA graphs capture them; where
:mod:`~..backend.triton_runtime` refuses, the PyTorch Function computes
the same gradients.
"""
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import availability, dispatch, triton_runtime

__all__ = [
    'usable', 'refusal', 'filtered_conv2d', 'collapsed_backward',
    'collapsed_backward_from', 'patch_sums', 'backward_calls',
    'fused_products', 'GradPrologue', 'conv_context'
]

Patches = Tuple[int, int, int]  # (start, size, count) along one axis
_calls = 0


class GradPrologue(NamedTuple):
    """What the pass over ``g_y`` applies to each element first, the forward in
    reverse: a bit-masked activation's backward (``bits`` at ``bit_strides``,
    ``off_scale`` where unset), then a frozen norm's per-channel factor.
    """
    bits: Tensor
    bit_strides: Tuple[int, int, int, int]
    off_scale: float
    running_var: Tensor
    weight: Optional[Tensor]
    eps: float


def refusal(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[str]:
    """Why this conv may not take the Triton path, or None.

    The caller checks that the kernel collapses on both axes.
    """
    reason = availability.triton_refusal(x)
    if reason is not None:
        return reason
    if x.dim() != 4 or x.numel() == 0 or weight.numel() == 0:
        return 'empty or not 4-D'
    if not (x.is_contiguous()
            or x.is_contiguous(memory_format=torch.channels_last)):
        return 'input neither contiguous nor channels-last'
    floats = triton_runtime.FLOAT_TYPES
    if x.dtype not in floats or weight.dtype not in floats or (
            bias is not None and bias.dtype not in floats):
        return f'{x.dtype} input'
    if weight.device != x.device:
        return 'weight on another device'
    return None


def usable(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether this conv may take the Triton path."""
    return refusal(x, weight, bias) is None


def _import_kernels():
    from . import kernels  # imports triton: only when first used
    return kernels


def _import_products():
    from . import products_kernels  # imports triton: only when first used
    return products_kernels


_kernels = triton_runtime.lazy_module(_import_kernels)
_products = triton_runtime.lazy_module(_import_products)


def backward_calls() -> int:
    """Eager backward calls that ran the Triton kernels (a diagnostic)."""
    return _calls


def fused_products() -> bool:
    """Whether the patch-grid products run as one fused launch."""
    return dispatch.choose('grid_products').implementation.name == 'fused'


def _tap_sums(weight: Tensor, acc: torch.dtype) -> Tensor:
    """``W~``: the kernel summed over its taps, ``Co x Ci/groups`` in
    ``acc``.
    """
    flat = weight.reshape(weight.shape[0], weight.shape[1], -1)
    if flat.shape[2] == 1:
        return flat[..., 0].to(acc)
    return flat.sum(-1, dtype=acc)


def _input_grad_buffer(grad_output: Tensor, channels: int, height: int,
                       width: int, dtype: torch.dtype) -> Tensor:
    """The uninitialised ``g_x``: channels-last when ``g_y`` is, else NCHW."""
    fmt = (torch.channels_last if grad_output.dim() == 4
           and not grad_output.is_contiguous()
           and grad_output.is_contiguous(memory_format=torch.channels_last)
           else torch.contiguous_format)
    return torch.empty((grad_output.shape[0], channels, height, width),
                       dtype=dtype, device=grad_output.device,
                       memory_format=fmt)


def _patch_sums(x: Tensor, row_start: int, row_size: int, row_count: int,
               col_start: int, col_size: int, col_count: int) -> Tensor:
    """``x~``: patch sums of ``x``, channel-major ``Ci x N x ph x pw``."""
    with triton_runtime.on_device(x):
        return _kernels().patch_sums(x, (row_start, row_size, row_count),
                                     (col_start, col_size, col_count))


patch_sums = torch.library.custom_op('mmseg_gf::triton_patch_sums',
                                    _patch_sums, mutates_args=())


@patch_sums.register_fake
def _(x, row_start, row_size, row_count, col_start, col_size, col_count):
    return x.new_empty((x.shape[1], x.shape[0], row_count, col_count))


def _empty(like: Tensor) -> Tensor:
    """The stand-in for a gradient nobody asked for (ops cannot return
    None).
    """
    return like.new_empty((0, ))


def _collapsed_backward(grad_output: Tensor, input_pooled: Optional[Tensor],
                       weight: Tensor, groups: int, scale: float,
                       input_height: int, input_width: int, rows: List[int],
                       cols: List[int], radius: int,
                       input_dtype: torch.dtype, need_input: bool,
                       need_weight: bool, need_bias: bool
                       ) -> Tuple[Tensor, Tensor, Tensor]:
    """Steps 1-4 and the bias (docs/gradient_filter.md, "Backward") for a
    kernel that collapses on both axes; ``scale = 1/s^2``.

    Returns ``(g_x, g_W, g_b)``, an empty tensor for each one not asked for.
    """
    return collapsed_backward_from(
        grad_output, None, input_pooled, weight, groups, scale, input_height,
        input_width, rows, cols, radius, input_dtype, need_input,
        need_weight, need_bias)


def collapsed_backward_from(grad: Tensor, prologue,
                            input_pooled: Optional[Tensor], weight: Tensor,
                            groups: int, scale: float, input_height: int,
                            input_width: int, rows: List[int],
                            cols: List[int], radius: int,
                            input_dtype: torch.dtype, need_input: bool,
                            need_weight: bool, need_bias: bool
                            ) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`_collapsed_backward` from ``grad`` or, with a ``prologue``
    (:class:`GradPrologue`), from the gradient after a frozen norm and
    bit-masked activation, applied as ``grad`` is read.
    """
    global _calls
    _calls += 1
    kernels = _kernels()
    acc = torch.promote_types(weight.dtype, torch.float32)
    co, ci_g = weight.shape[:2]
    co_g = co // groups
    fused = fused_products()
    with triton_runtime.on_device(grad), triton_runtime.no_autocast(grad):
        # W~ of a k x k kernel, for the fused input product: summed in the
        # pass over g_y's launch (a 1 x 1 kernel is its own W~)
        taps = None
        if fused and need_input and weight.shape[2] * weight.shape[3] > 1:
            taps = (weight.contiguous(),
                    grad.new_empty((co, ci_g), dtype=acc))
        means, partial = kernels.output_grad_means(grad, radius, scale, acc,
                                                   prologue, taps)
        if fused:
            kernel = (taps[1] if taps is not None else
                      weight.reshape(co, ci_g) if need_input else None)
            return _fused_backward(means, partial, input_pooled, weight,
                                   kernel, grad, input_height, input_width,
                                   rows, cols, input_dtype, need_input,
                                   need_weight, need_bias, groups)
        # Three distinct tensors: op outputs must not alias each other.
        grad_x, grad_w, grad_b = (_empty(grad) for _ in range(3))
        if need_bias:
            grad_b = partial.sum(dim=(0, 2))
        # N x ph x pw: the GEMMs' long axis
        cells = means.shape[1] * means.shape[2] * means.shape[3]
        if need_weight:
            pooled = input_pooled.to(acc)
            if co_g == 1 and ci_g == 1:  # depthwise: one dot per channel
                grad_w = torch.bmm(means.reshape(co, 1, cells),
                                   pooled.reshape(co, cells, 1)).reshape(
                                       co, 1)
            else:
                grad_w = torch.bmm(
                    means.reshape(groups, co_g, cells),
                    pooled.reshape(groups, ci_g, cells).transpose(1, 2)
                ).reshape(co, ci_g)
            # every tap the same, stored in full (autograd would copy a
            # broadcast gradient into .grad anyway)
            grad_w = grad_w.reshape(co, ci_g, 1, 1).expand_as(weight).to(
                weight.dtype).contiguous()
        if need_input:
            # W~ = sum of the taps; g_x~ = W~^T g~ per group, channel-major.
            kernel = _tap_sums(weight, acc).reshape(groups, co_g, ci_g)
            if co_g == 1 and ci_g == 1:
                grid = means * kernel.reshape(co, 1, 1, 1)
            else:
                grid = torch.bmm(kernel.transpose(1, 2),
                                 means.reshape(groups, co_g, cells))
            n = grad.shape[0]
            grid = grid.reshape(groups * ci_g, n, *means.shape[2:])
            grad_x = kernels.spread(
                grid.permute(1, 0, 2, 3),
                _input_grad_buffer(grad, groups * ci_g, input_height,
                                   input_width, input_dtype),
                tuple(rows), tuple(cols))
    return grad_x, grad_w, grad_b


def _fused_backward(means: Tensor, partial: Tensor,
                    input_pooled: Optional[Tensor], weight: Tensor,
                    tap_sums: Optional[Tensor], grad_output: Tensor,
                    input_height: int, input_width: int, rows: List[int],
                    cols: List[int], input_dtype: torch.dtype,
                    need_input: bool,
                    need_weight: bool, need_bias: bool, groups: int
                    ) -> Tuple[Tensor, Tensor, Tensor]:
    """``g_W``, ``g_b`` and ``g_x`` in one launch after the pass over
    ``g_y``.
    """
    products = _products()
    out = None
    if need_input:
        rows, cols = tuple(rows), tuple(cols)
        out = _input_grad_buffer(grad_output, groups * weight.shape[1],
                                 input_height, input_width, input_dtype)
        if not (products.covers(rows, input_height)
                and products.covers(cols, input_width)):
            out.zero_()
    pooled = (input_pooled.reshape(input_pooled.shape[0], -1)
              if need_weight else None)
    grad_w, grad_b = products.products(
        means, pooled, partial, weight, tap_sums, out, rows, cols,
        need_weight, need_bias, groups=groups)
    # Three distinct tensors: op outputs must not alias each other.
    return tuple(_empty(grad_output) if g is None or g.numel() == 0 else g
                 for g in (out, grad_w, grad_b))


collapsed_backward = torch.library.custom_op(
    'mmseg_gf::triton_collapsed_backward', _collapsed_backward,
    mutates_args=())


@collapsed_backward.register_fake
def _(grad_output, input_pooled, weight, groups, scale, input_height,
      input_width, rows, cols, radius, input_dtype, need_input, need_weight,
      need_bias):
    acc = torch.promote_types(weight.dtype, torch.float32)
    co, ci_g = weight.shape[:2]
    # Three distinct tensors: op outputs must not alias each other.
    grad_x, grad_w, grad_b = (_empty(grad_output) for _ in range(3))
    if need_input:
        grad_x = _input_grad_buffer(grad_output, groups * ci_g,
                                    input_height, input_width, input_dtype)
    if need_weight:
        grad_w = torch.empty_like(weight,
                                  memory_format=torch.contiguous_format)
    if need_bias:
        grad_b = grad_output.new_empty((co, ), dtype=acc)
    return grad_x, grad_w, grad_b


def conv_context(x: Tensor, stride: Tuple[int, int], groups: int,
                 radius: int, rows: Patches, cols: Patches) -> tuple:
    """What a filtered conv's backward needs of its forward call, in
    :func:`collapsed_backward_from`'s order.
    """
    return (groups, 1.0 / (stride[0] * stride[1]), x.shape[2], x.shape[3],
            rows, cols, radius, x.dtype)


class TritonFilteredConv2d(torch.autograd.Function):
    """``F.conv2d`` forward and the filtered backward on the Triton path (the
    same gradients as ``GradientFilterConv2dFunction``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                stride: Tuple[int, int], padding: Tuple[int, int],
                dilation: Tuple[int, int], groups: int, radius: int,
                rows: Patches, cols: Patches) -> Tensor:
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        # Never save x: only its patch sums, and only if g_W will be needed.
        pooled = (triton_runtime.call(patch_sums, _patch_sums, x, *rows, *cols)
                  if ctx.needs_input_grad[1] else None)
        ctx.save_for_backward(pooled, weight)
        ctx.conv = conv_context(x, stride, groups, radius, rows, cols)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        pooled, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        groups, scale, height, width, rows, cols, radius, x_dtype = ctx.conv
        grad_x, grad_w, grad_b = triton_runtime.call(
            collapsed_backward, _collapsed_backward, grad_output, pooled,
            weight, groups, scale, height, width, list(rows), list(cols),
            radius, x_dtype, need_x, need_w, need_b)
        return (grad_x if need_x else None,
                grad_w if need_w else None,
                grad_b.to(ctx.bias_dtype) if need_b else None,
                None, None, None, None, None, None, None)


def filtered_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                    stride: Tuple[int, int], padding: Tuple[int, int],
                    dilation: Tuple[int, int], groups: int, radius: int,
                    rows: Patches, cols: Patches) -> Tensor:
    """``F.conv2d`` with the Triton-path backward, for a :func:`usable` ``x``;
    ``rows`` / ``cols`` are the input patches ``Q(P)``.
    """
    return TritonFilteredConv2d.apply(x, weight, bias, stride, padding,
                                      dilation, groups, radius, rows, cols)
