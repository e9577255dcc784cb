"""The patch grid: where a filtered layer's ``r x r`` patches lie, and the
operations every filtered kind shares (docs/gradient_filter.md, "Patch
geometry"): patch means of ``g_y``, patch sums of the input, and the spread
back over input patches. A token grid is a 1x1 kernel, stride 1.
"""
import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import dispatch, shape_caches
from .conv import cpu as conv_cpu

IntPair = Union[int, Tuple[int, int]]


def as_pair(value: IntPair) -> Tuple[int, int]:
    """``(h, w)`` from an int or a pair (conv hyper-parameters)."""
    if isinstance(value, int):
        return value, value
    return int(value[0]), int(value[1])


#: The largest patch size ``r``: a patch of 65536 x 65536 pixels covers
#: any feature map a segmentor filters, and every index the kernels compute
#: from it (``H + r``, ``r * stride``, ``r * r``) stays far inside int64
#: (the compiled kernels check the same bound: ``csrc/patch_kernels.h``).
MAX_RADIUS = 1 << 16


def check_radius(radius) -> int:
    """Validate a patch size ``r`` and return it as an ``int``.

    Raises:
        ValueError: ``radius`` is not an integer in ``[1, MAX_RADIUS]``
            (``bool`` included).
    """
    if isinstance(radius, bool) or not isinstance(radius, int) or \
            not 1 <= radius <= MAX_RADIUS:
        raise ValueError(
            f'gradient filter radius must be an int >= 1 and <= '
            f'{MAX_RADIUS} (a patch side; larger than any feature map), '
            f'got {radius!r}')
    return radius


@dataclass(frozen=True)
class AxisGeometry:
    """Where the patches lie along one axis, in the symbols of
    docs/gradient_filter.md, "Patch geometry"; ``pooled_dilation`` is 0 when
    the kernel is summed on this axis.
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
        """All taps fall in one patch: the kernel is summed here."""
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
        """F.pad amounts (before, after) onto the patch-covered pixels;
        negative crops.
        """
        covered = self.num_patches * self.in_patch
        return -self.in_start, self.in_start + covered - self.in_size


def _fit_to_patches(t: Tensor, geo_h: AxisGeometry,
                    geo_w: AxisGeometry) -> Tensor:
    """Pad or crop ``t`` to the patch-covered area (negated pads: back to the
    input's frame).
    """
    top, bottom = geo_h.input_pads
    left, right = geo_w.input_pads
    if top == bottom == left == right == 0:
        return t
    return F.pad(t, (left, right, top, bottom))


def _kernel_takes(t: Tensor) -> bool:
    """Whether the compiled kernels run ``t``'s patch sums or spread."""
    return dispatch.choose('patch_grid', t).implementation.name == 'c++'


def pool_input_patches(x: Tensor, geo_h: AxisGeometry,
                       geo_w: AxisGeometry) -> Tensor:
    """Patch sums ``x~[n, ci, P] = sum_{Q(P)} x`` (docs/gradient_filter.md,
    "Forward"), in ``x``'s dtype with float32 accumulation.
    """
    if _kernel_takes(x):
        return conv_cpu.patch_sums(x, geo_h.input_patches, geo_w.input_patches,
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

    One pass; border patches average over their valid pixels. Returns ``(sums,
    scale * means)`` in ``acc_dtype``; the sums give the exact bias gradient.
    """
    if _kernel_takes(grad_output):
        sums = conv_cpu.patch_sums(grad_output, geo_h.output_patches,
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


def spread_to_input(grad_pooled: Tensor, geo_h: AxisGeometry,
                    geo_w: AxisGeometry) -> Tensor:
    """Broadcast each pooled cell over its input patch ``Q(P)`` (Eq. 3), 0
    elsewhere, as two broadcasts with contiguous inner dimensions
    (docs/benchmarks/design_measurements.md).
    """
    if dispatch.choose('patch_spread',
                       grad_pooled).implementation.name == 'c++':
        grid = grad_pooled.contiguous()  # small (patch grid): cheap if needed
        return conv_cpu.spread(grid, geo_h.in_size, geo_w.in_size,
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


def conv_geometry(x: Tensor, weight: Tensor, stride: Tuple[int, int],
                  padding: Tuple[int, int], dilation: Tuple[int, int],
                  radius: int) -> Tuple[AxisGeometry, AxisGeometry]:
    """The patch geometry of ``F.conv2d(x, weight, ...)`` along H and W, cached
    per sizes (computed afresh under ``torch.compile``).
    """
    axis = (_axis_geometry.__wrapped__ if torch.compiler.is_compiling()
            else _axis_geometry)
    return (axis(x.shape[2], weight.shape[2], stride[0], padding[0],
                 dilation[0], radius),
            axis(x.shape[3], weight.shape[3], stride[1], padding[1],
                 dilation[1], radius))


#: Axes whose geometry is kept (``shape_caches.lru``): a model has a few
#: dozen distinct (size, kernel, stride, padding, dilation, r) per input
#: size.
_GEOMETRY_CACHED = 1024


@shape_caches.lru('patch_grid.axis_geometry', _GEOMETRY_CACHED)
def _axis_geometry(size: int, kernel: int, stride: int, padding: int,
                   dilation: int, radius: int) -> AxisGeometry:
    out = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return AxisGeometry.of(size, out, kernel, stride, padding, dilation,
                           radius)


def collapsed_patches(x: Tensor, weight: Tensor, stride: Tuple[int, int],
                      padding: Tuple[int, int], dilation: Tuple[int, int],
                      radius: int
                      ) -> Optional[Tuple[Tuple[int, int, int],
                                          Tuple[int, int, int]]]:
    """The input patches ``Q(P)`` along H and W of a conv whose kernel
    collapses on both axes, else None.
    """
    geo_h, geo_w = conv_geometry(x, weight, stride, padding, dilation,
                                 radius)
    if not (geo_h.collapsed and geo_w.collapsed):
        return None
    return geo_h.input_patches, geo_w.input_patches


def resolve_padding(padding: Union[str, IntPair], kernel_size: Sequence[int],
                    dilation: Sequence[int]) -> Tuple[Tuple[int, int],
                                                      Optional[List[int]]]:
    """Turn ``nn.Conv2d``'s padding into ``(symmetric padding, extra F.pad or
    None)``: an odd ``'same'`` total puts the extra pixel after, as
    ``F.conv2d``.
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


def autocast_off(device_type: str):
    """Disable autocast in a filtered backward (float32 accumulation); a no-op
    where autocast does not know the device.
    """
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
