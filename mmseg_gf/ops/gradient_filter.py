"""Gradient-filtered 2-D convolution: exact forward, filtered backward.

This module is the single implementation of the math in
``docs/gradient_filter.md`` (Yang, Li, Marculescu, CVPR 2023, Eq. 2, 3, 5
and Supplement A.5-A.6). It is pure PyTorch (no mmseg / mmcv import) so
any PyTorch user can call :func:`gradient_filtered_conv2d` directly.

The idea in one paragraph: cut the output gradient ``g_y`` into ``r x r``
patches and replace every patch by its mean. A patch-constant ``g_y`` makes the
convolution's backward collapse onto a small "pooled grid" (one cell per
patch): the input gradient becomes a channel-mixing product with the
spatially summed kernel, broadcast back over the patch, and the weight
gradient becomes a product of patch means with patch sums of ``x``. Those
patch sums of ``x`` (``1/r^2`` of its size for stride 1) are all the forward
keeps, which is where the activation-memory saving comes from.

One mechanism serves every conv kind. Along an axis where the kernel's taps
stay within one patch (dilation ``d < r*s``), the kernel is summed over that
axis; along an axis where taps reach other patches (``d >= r*s``, dilated
convs of DeepLabV3 / ResNet-d8), the kernel keeps its taps and is applied on
the pooled grid with dilation ``d // (r*s)``. The backward is then the exact
backward of that small convolution on the pooled grid, scaled by ``1/s^2``.
"""

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import native, triton_path

IntPair = Union[int, Tuple[int, int]]


def as_pair(value: IntPair) -> Tuple[int, int]:
    """``(h, w)`` from an int or a pair (conv hyper-parameters)."""
    if isinstance(value, int):
        return value, value
    return int(value[0]), int(value[1])


def check_radius(radius) -> int:
    """Validate a patch size ``r`` and return it as an ``int``.

    Raises:
        ValueError: if ``radius`` is not an integer >= 1 (``bool`` is refused
            too: ``True`` is almost certainly a configuration mistake).
    """
    if isinstance(radius, bool) or not isinstance(radius, int) or radius < 1:
        raise ValueError(
            f'gradient filter radius must be an int >= 1, got {radius!r}')
    return radius


@dataclass(frozen=True)
class AxisGeometry:
    """Where the patches lie along one spatial axis
    (docs/gradient_filter.md#patch-geometry).

    Attributes:
        num_patches: ``ceil(out_size / r)`` patches along the axis.
        out_patch: ``r``, output pixels per patch.
        in_patch: ``r * s``, input pixels per patch ``Q(P)``.
        in_start: first input pixel of ``Q(0)``; ``c = ((k-1)*d)//2 - p``,
            which may be negative or run past the map (zero padding there).
        pooled_dilation: dilation of the kernel on the pooled grid,
            ``d // (r*s)``; 0 means every tap stays within one patch, so the
            kernel is summed over this axis.
        pooled_centre: index of the kernel tap that reads the patch itself,
            ``(k-1)//2``, used only when ``pooled_dilation >= 1``.
    """

    in_size: int
    out_size: int
    num_patches: int
    out_patch: int
    in_patch: int
    in_start: int
    pooled_dilation: int
    pooled_centre: int
    kernel: int

    @classmethod
    def of(cls, in_size: int, out_size: int, kernel: int, stride: int,
           padding: int, dilation: int, radius: int) -> 'AxisGeometry':
        return cls(
            in_size=in_size,
            out_size=out_size,
            num_patches=-(-out_size // radius),
            out_patch=radius,
            in_patch=radius * stride,
            in_start=((kernel - 1) * dilation) // 2 - padding,
            pooled_dilation=dilation // (radius * stride),
            pooled_centre=(kernel - 1) // 2,
            kernel=kernel)

    @property
    def collapsed(self) -> bool:
        """True when all taps fall in one patch: the kernel is summed here."""
        return self.pooled_dilation == 0 or self.kernel == 1

    @property
    def input_patches(self) -> Tuple[int, int, int]:
        """``(start, size, count)`` of the patches ``Q(P)`` on the input."""
        return self.in_start, self.in_patch, self.num_patches

    @property
    def output_patches(self) -> Tuple[int, int, int]:
        """``(start, size, count)`` of the ``r``-patches on the output."""
        return 0, self.out_patch, self.num_patches

    @property
    def pooled_pads(self) -> Tuple[int, int]:
        """Zero padding (before, after) of the pooled grid for the taps."""
        if self.collapsed:
            return 0, 0
        before = self.pooled_centre * self.pooled_dilation
        after = (self.kernel - 1 - self.pooled_centre) * self.pooled_dilation
        return before, after

    @property
    def input_pads(self) -> Tuple[int, int]:
        """F.pad amounts (before, after) mapping the input axis onto the
        ``num_patches * in_patch`` pixels covered by the patches; negative
        values crop."""
        covered = self.num_patches * self.in_patch
        return -self.in_start, self.in_start + covered - self.in_size


def _fit_to_patches(t: Tensor, geo_h: AxisGeometry,
                    geo_w: AxisGeometry) -> Tensor:
    """Pad (zeros) or crop ``t`` so that it is exactly the patch-covered area.

    Used both ways: on ``x`` before pooling, and (with negated pads) on the
    spread input gradient to place it back into the input's frame.
    """
    top, bottom = geo_h.input_pads
    left, right = geo_w.input_pads
    if top == bottom == left == right == 0:
        return t
    return F.pad(t, (left, right, top, bottom))


def pool_input_patches(x: Tensor, geo_h: AxisGeometry,
                       geo_w: AxisGeometry) -> Tensor:
    """Patch sums ``x~[n, ci, P] = sum_{Q(P)} x``
    (docs/gradient_filter.md#forward).

    Returns a ``N x Ci x ceil(Ho/r) x ceil(Wo/r)`` tensor in ``x``'s dtype
    (pooling accumulates in float32 for reduced-precision inputs). The
    compiled kernel lays it out channel-major in memory, ready for the
    fused backward's weight GEMM.
    """
    if native.usable(x):
        return native.patch_sums(x, geo_h.input_patches, geo_w.input_patches,
                                 channel_major=True)
    covered = _fit_to_patches(x, geo_h, geo_w)
    return F.avg_pool2d(
        covered, (geo_h.in_patch, geo_w.in_patch), divisor_override=1)


def _patch_pixel_counts(geo: AxisGeometry, device, dtype) -> Tensor:
    """Valid output pixels per patch along one axis (the last may be short)."""
    starts = torch.arange(geo.num_patches, device=device) * geo.out_patch
    return (geo.out_size - starts).clamp(max=geo.out_patch).to(dtype)


def filter_output_grad(grad_output: Tensor, geo_h: AxisGeometry,
                       geo_w: AxisGeometry, acc_dtype: torch.dtype,
                       scale: float = 1.0) -> Tuple[Tensor, Tensor]:
    """The gradient filter: per-patch sums and means of ``g_y`` (Eq. 2).

    One pass over ``g_y``; partial border patches average over their valid
    pixels only. Returns ``(sums, scale * means)`` in ``acc_dtype``; the sums
    also give the exact bias gradient without a second pass.
    """
    if native.usable(grad_output):
        sums = native.patch_sums(grad_output, geo_h.output_patches,
                                 geo_w.output_patches).to(acc_dtype)
    else:
        kernel = (min(geo_h.out_patch, geo_h.out_size),
                  min(geo_w.out_patch, geo_w.out_size))
        sums = F.avg_pool2d(
            grad_output, kernel, (geo_h.out_patch, geo_w.out_patch),
            ceil_mode=True, divisor_override=1).to(acc_dtype)
    exact_tiling = (geo_h.out_size % geo_h.out_patch == 0
                    and geo_w.out_size % geo_w.out_patch == 0)
    if exact_tiling:
        means = sums * (scale / (geo_h.out_patch * geo_w.out_patch))
    else:
        counts_h = _patch_pixel_counts(geo_h, sums.device, acc_dtype)
        counts_w = _patch_pixel_counts(geo_w, sums.device, acc_dtype)
        means = sums * (scale / (counts_h.unsqueeze(1) * counts_w))
    return sums, means


def pooled_kernel(weight: Tensor, geo_h: AxisGeometry,
                  geo_w: AxisGeometry) -> Tensor:
    """The kernel as seen on the pooled grid: summed over collapsed axes.

    Both axes collapsed gives ``W~[co, ci] = sum_{u,v} W[co, ci, u, v]``
    (docs/gradient_filter.md#backward, step 2) as a ``1 x 1`` kernel,
    computed as a matrix-vector product: a reduction over the short
    contiguous tap axis vectorises poorly, and for 512x512 kernels this read
    dominates small layers.
    """
    if geo_h.collapsed and geo_w.collapsed:
        co, ci_g, kh, kw = weight.shape
        taps = weight.new_ones(kh * kw)
        return (weight.reshape(co * ci_g, kh * kw) @ taps).reshape(
            co, ci_g, 1, 1)
    dims = [dim for dim, geo in ((2, geo_h), (3, geo_w)) if geo.collapsed]
    return weight.sum(dim=dims, keepdim=True) if dims else weight


def spread_to_input(grad_pooled: Tensor, geo_h: AxisGeometry,
                    geo_w: AxisGeometry) -> Tensor:
    """Broadcast each pooled cell over its input patch ``Q(P)`` (Eq. 3).

    Written in two broadcasts, first along the width (a ``1/r`` sized
    intermediate), then whole rows along the height: both copies have a
    contiguous inner dimension, about twice as fast on CPU as one 6-D
    expand. Pixels outside every ``Q(P)`` get 0.
    """
    if grad_pooled.device.type == 'cpu':
        grid = grad_pooled.contiguous()  # small (patch grid): cheap if needed
        if native.usable(grid):
            return native.spread(grid, geo_h.in_size, geo_w.in_size,
                                 geo_h.input_patches, geo_w.input_patches)
    n, c, ph, pw = grad_pooled.shape
    ih, iw = geo_h.in_patch, geo_w.in_patch
    rows = grad_pooled.unsqueeze(-1).expand(n, c, ph, pw, iw).reshape(
        n, c, ph, 1, pw * iw)
    spread = rows.expand(n, c, ph, ih, pw * iw).reshape(
        n, c, ph * ih, pw * iw)
    top, bottom = geo_h.input_pads
    left, right = geo_w.input_pads
    if top == bottom == left == right == 0:
        return spread
    return F.pad(spread, (-left, -right, -top, -bottom))


def _pad_pooled(t: Tensor, geo_h: AxisGeometry, geo_w: AxisGeometry) -> Tensor:
    top, bottom = geo_h.pooled_pads
    left, right = geo_w.pooled_pads
    if top == bottom == left == right == 0:
        return t
    return F.pad(t, (left, right, top, bottom))


def _channel_mixing_backward(
    grad_pooled: Tensor,
    input_pooled: Optional[Tensor],
    kernel: Tensor,
    groups: int,
    need_input: bool,
    need_weight: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Backward of a grouped ``1 x 1`` convolution as matrix products.

    The usual (non-dilated) case: ``g_x~ = W~^T g~`` and ``g_W~ = g~ x~^T``
    per group, with batch and patch grid flattened into one axis so that
    each group is a single large GEMM (one per group, not one per image).
    Depthwise convs are elementwise. Direct products avoid the large fixed
    cost of a general convolution backward on such small tensors.
    """
    n, co, ph, pw = grad_pooled.shape
    co_g, ci_g = co // groups, kernel.shape[1]
    grad_input = grad_kernel = None
    if co_g == 1 and ci_g == 1:  # depthwise
        if need_input:
            grad_input = grad_pooled * kernel.reshape(1, co, 1, 1)
        if need_weight:
            grad_kernel = (grad_pooled * input_pooled).sum(
                dim=(0, 2, 3)).reshape(co, 1, 1, 1)
        return grad_input, grad_kernel

    cells = ph * pw
    if need_input:
        # (g, ci_g, co_g) @ (n, g, co_g, cells) -> (n, g, ci_g, cells):
        # broadcast over the batch, output already in NCHW order.
        mixing = kernel.reshape(groups, co_g, ci_g).transpose(1, 2)
        grad_input = torch.matmul(
            mixing, grad_pooled.reshape(n, groups, co_g, cells)).reshape(
                n, groups * ci_g, ph, pw)
    if need_weight:
        grad_kernel = _pooled_weight_grad(grad_pooled, input_pooled,
                                          groups).reshape(
                                              groups * co_g, ci_g, 1, 1)
    return grad_input, grad_kernel


def _pooled_weight_grad(grad_pooled: Tensor, input_pooled: Tensor,
                        groups: int) -> Tensor:
    """``g_W~ = sum_n g~_n x~_n^T`` per group, as ``(g, co_g, ci_g)``.

    Two ways to the same sum, chosen by which moves less memory:

    * one GEMM per image, straight on the NCHW grids (no copies), then a
      sum over the batch of the ``n x Co x Ci_g`` partial products; best
      when the patch grid is large next to the channels (128 channels on
      a 60x80 grid: 3x faster on CPU);
    * batch and cells gathered into one long axis (a permuted copy of both
      grids, ``(Co + Ci) x n x cells`` elements), then one GEMM per group;
      best when the grid is small and the channel product large (e.g.
      512 channels on a 4x4 grid), where the per-image partial products
      would dominate.

    The per-image way is taken only when its partial products are at most a
    quarter of the gathered copies: near the break-even point the single
    long GEMM was as fast or faster in our CPU measurements.
    """
    n, co, ph, pw = grad_pooled.shape
    ci = input_pooled.shape[1]
    co_g, ci_g, cells = co // groups, ci // groups, ph * pw
    if 4 * co_g * ci <= (co + ci) * cells:
        return torch.matmul(
            grad_pooled.reshape(n, groups, co_g, cells),
            input_pooled.reshape(n, groups, ci_g, cells).transpose(
                2, 3)).sum(dim=0)

    def by_group(t: Tensor, per_group: int) -> Tensor:
        return t.reshape(n, groups, per_group, cells).permute(
            1, 2, 0, 3).reshape(groups, per_group, n * cells)

    return torch.bmm(
        by_group(grad_pooled, co_g),
        by_group(input_pooled, ci_g).transpose(1, 2))


def pooled_conv_backward(
    grad_pooled: Tensor,
    input_pooled: Optional[Tensor],
    kernel: Tensor,
    geo_h: AxisGeometry,
    geo_w: AxisGeometry,
    groups: int,
    need_input: bool,
    need_weight: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Exact backward of the small convolution on the pooled grid.

    The forward it differentiates is ``y~ = conv2d(pad(x~), kernel,
    dilation=pooled_dilation)``, a stride-1 convolution whose output grid is
    the patch grid. Collapsed axes have a kernel of size 1, so in the usual
    (non-dilated) case this is a pair of channel-mixing matrix products.

    Returns:
        ``(grad wrt x~ on the patch grid, grad wrt the pooled kernel)``.
    """
    if geo_h.collapsed and geo_w.collapsed:
        return _channel_mixing_backward(grad_pooled, input_pooled, kernel,
                                        groups, need_input, need_weight)
    n = grad_pooled.shape[0]
    ci = kernel.shape[1] * groups
    top, bottom = geo_h.pooled_pads
    left, right = geo_w.pooled_pads
    padded_shape = (n, ci, geo_h.num_patches + top + bottom,
                    geo_w.num_patches + left + right)
    if input_pooled is None:
        # Only the shape is used when the weight gradient is not asked for.
        padded_input = grad_pooled.new_empty(padded_shape)
    else:
        padded_input = _pad_pooled(input_pooled, geo_h, geo_w)
    dilation = (max(geo_h.pooled_dilation, 1), max(geo_w.pooled_dilation, 1))
    grad_input, grad_kernel, _ = torch.ops.aten.convolution_backward(
        grad_pooled, padded_input, kernel, None, [1, 1], [0, 0],
        list(dilation), False, [0, 0], groups,
        [need_input, need_weight, False])
    if grad_input is not None and (top or bottom or left or right):
        grad_input = grad_input.narrow(2, top, geo_h.num_patches).narrow(
            3, left, geo_w.num_patches)
    return grad_input, grad_kernel


def _autocast_off(device_type: str):
    """Disable autocast in the backward (accumulation stays float32);
    a no-op context on devices autocast does not know (e.g. ``meta``)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def conv_geometry(x: Tensor, weight: Tensor, stride: Tuple[int, int],
                  padding: Tuple[int, int], dilation: Tuple[int, int],
                  radius: int) -> Tuple[AxisGeometry, AxisGeometry]:
    """The patch geometry of ``F.conv2d(x, weight, ...)`` along H and W."""
    geometry = []
    for axis in (0, 1):
        size, kernel = x.shape[2 + axis], weight.shape[2 + axis]
        out = (size + 2 * padding[axis] - dilation[axis] *
               (kernel - 1) - 1) // stride[axis] + 1
        geometry.append(
            AxisGeometry.of(size, out, kernel, stride[axis], padding[axis],
                            dilation[axis], radius))
    return geometry[0], geometry[1]


class GradientFilterConv2dFunction(torch.autograd.Function):
    """Autograd Function: ``F.conv2d`` forward, gradient-filter backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                stride: Tuple[int, int], padding: Tuple[int, int],
                dilation: Tuple[int, int], groups: int,
                radius: int) -> Tensor:
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        geo_h, geo_w = conv_geometry(x, weight, stride, padding, dilation,
                                     radius)
        # Never save x: only its patch sums, and only if g_W will be needed.
        x_pooled = (
            pool_input_patches(x, geo_h, geo_w)
            if ctx.needs_input_grad[1] else None)
        ctx.save_for_backward(x_pooled, weight)
        ctx.geometry = (geo_h, geo_w)
        ctx.groups = groups
        ctx.stride_area = stride[0] * stride[1]
        ctx.input_dtype = x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        x_pooled, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if _fusable(ctx, grad_output, x_pooled, weight):
            grad_x, grad_w, grad_b = _fused_backward(ctx, grad_output,
                                                     x_pooled, weight)
        else:
            grad_x, grad_w, grad_b = _stepwise_backward(
                ctx, grad_output, x_pooled, weight)
        if need_w:
            grad_w = grad_w.expand_as(weight).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _fusable(ctx, grad_output: Tensor, x_pooled: Optional[Tensor],
             weight: Tensor) -> bool:
    """Whether the compiled one-call backward applies: the kernel collapses
    on both axes and every tensor is a CPU NCHW tensor of one float dtype."""
    geo_h, geo_w = ctx.geometry
    dtype = grad_output.dtype
    return (geo_h.collapsed and geo_w.collapsed and native.usable(grad_output)
            and weight.dtype == dtype and ctx.input_dtype == dtype
            and (x_pooled is None or x_pooled.dtype == dtype))


def _fused_backward(ctx, grad_output: Tensor, x_pooled: Optional[Tensor],
                    weight: Tensor):
    """Steps 1-4 of docs/gradient_filter.md#backward in one compiled call
    (see ``native``)."""
    geo_h, geo_w = ctx.geometry
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    return native.collapsed_backward(
        grad_output, x_pooled, weight, ctx.groups, 1.0 / ctx.stride_area,
        (geo_h.in_size, geo_w.in_size), geo_h.input_patches,
        geo_w.input_patches, geo_h.out_patch, need_x, need_w, need_b)


def _stepwise_backward(ctx, grad_output: Tensor, x_pooled: Optional[Tensor],
                       weight: Tensor):
    """Steps 1-4 of docs/gradient_filter.md#backward as PyTorch ops: every
    device, dtype and conv kind (dilated kernels included). Returns
    ``(g_x, g_W~, g_b)``."""
    geo_h, geo_w = ctx.geometry
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    with _autocast_off(grad_output.device.type):
        # 1/s^2 keeps the filtered gradients unbiased for strided convs
        # (docs/gradient_filter.md#stride-normalisation).
        sums, means = filter_output_grad(grad_output, geo_h, geo_w,
                                         acc_dtype, 1.0 / ctx.stride_area)
        # For the weight gradient alone only the kernel's shape matters:
        # skip reading (and summing) a possibly large weight.
        kernel = (
            pooled_kernel(weight.to(acc_dtype), geo_h, geo_w)
            if need_x or not (geo_h.collapsed and geo_w.collapsed) else
            weight.new_empty(()).expand(weight.shape[0], weight.shape[1], 1,
                                        1))
        grad_x_pooled, grad_kernel = pooled_conv_backward(
            means, None if x_pooled is None else x_pooled.to(acc_dtype),
            kernel, geo_h, geo_w, ctx.groups, need_x, need_w)
    grad_x = grad_b = None
    if need_x:
        grad_x = spread_to_input(
            grad_x_pooled.to(ctx.input_dtype), geo_h, geo_w)
    if need_b:
        grad_b = sums.sum(dim=(0, 2, 3)).to(weight.dtype)
    return grad_x, grad_kernel, grad_b


def resolve_padding(padding: Union[str, IntPair], kernel_size: Sequence[int],
                    dilation: Sequence[int]) -> Tuple[Tuple[int, int],
                                                      Optional[List[int]]]:
    """Turn ``nn.Conv2d``'s padding into numbers the Function can use.

    Returns ``(symmetric padding, extra F.pad or None)``: ``'same'`` with an
    even total is symmetric; an odd total (even kernel) puts the extra pixel
    after, as ``F.conv2d`` does, via an explicit ``F.pad``.
    """
    if not isinstance(padding, str):
        return as_pair(padding), None
    if padding == 'valid':
        return (0, 0), None
    if padding != 'same':
        raise ValueError(f'unsupported padding {padding!r}')
    pads, extra, asymmetric = [], [], False
    for k, d in zip(kernel_size, dilation):
        total = d * (k - 1)
        pads.append(total // 2)
        extra.append(total - 2 * (total // 2))
        asymmetric |= bool(total % 2)
    if not asymmetric:
        return (pads[0], pads[1]), None
    return (pads[0], pads[1]), [0, extra[1], 0, extra[0]]


def gradient_filtered_conv2d(x: Tensor,
                             weight: Tensor,
                             bias: Optional[Tensor] = None,
                             stride: IntPair = 1,
                             padding: Union[str, IntPair] = 0,
                             dilation: IntPair = 1,
                             groups: int = 1,
                             radius: int = 4) -> Tensor:
    """``F.conv2d`` whose backward is the gradient filter of patch size ``r``.

    Args:
        x: input, ``N x Ci x H x W``.
        weight: ``Co x Ci/groups x kh x kw``.
        bias: optional ``Co``; its gradient is exact.
        stride, padding, dilation, groups: as in ``F.conv2d`` (string
            padding ``'same'`` / ``'valid'`` included).
        radius: patch size ``r >= 1`` of the output-gradient patches.

    Returns:
        Exactly ``F.conv2d(x, weight, bias, stride, padding, dilation, groups)``.
    """
    radius = check_radius(radius)
    dilation = as_pair(dilation)
    pad, extra = resolve_padding(padding, weight.shape[2:], dilation)
    if extra is not None:
        x = F.pad(x, extra)
    return filtered_conv(x, weight, bias, as_pair(stride), pad, dilation,
                         groups, radius)


def filtered_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  stride: Tuple[int, int], padding: Tuple[int, int],
                  dilation: Tuple[int, int], groups: int,
                  radius: int) -> Tensor:
    """``F.conv2d`` with the gradient-filter backward; numeric padding.

    Three autograd nodes compute the same backward. The usual case (a
    kernel that collapses on both axes) takes a fused node where one
    applies: on a CUDA input (contiguous NCHW or channels-last) the Triton
    one (:func:`triton_path.filtered_conv2d`; on an H100 the step-by-step
    route's handful of small kernels was slower than cuDNN's exact
    backward);
    on a contiguous NCHW float CPU input with weight and bias of its dtype
    and autocast off the compiled C++ one (:func:`native.filtered_conv2d`;
    on small layers the Python Function's own overhead was ~10% of the
    backward). Everything else (other layouts and dtypes, dilated taps,
    CPU autocast, ``torch.compile`` on CPU, machines without the kernels)
    takes :class:`GradientFilterConv2dFunction`, the reference.
    """
    if triton_path.usable(x, weight, bias):
        fused = triton_path
    elif (native.usable(x) and weight.dtype == x.dtype
          and (bias is None or bias.dtype == x.dtype)
          and not torch.is_autocast_enabled('cpu')):
        fused = native
    else:
        fused = None
    if fused is not None:
        geo_h, geo_w = conv_geometry(x, weight, stride, padding, dilation,
                                     radius)
        if geo_h.collapsed and geo_w.collapsed:
            return fused.filtered_conv2d(x, weight, bias, stride, padding,
                                         dilation, groups, radius,
                                         geo_h.input_patches,
                                         geo_w.input_patches)
    return GradientFilterConv2dFunction.apply(x, weight, bias, stride,
                                              padding, dilation, groups,
                                              radius)
