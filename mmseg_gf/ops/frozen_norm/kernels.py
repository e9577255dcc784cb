"""Triton kernels of the frozen norms' backward (:mod:`.triton_norm`).

``_frozen_norm_backward`` writes ``g_x = g * (rsqrt(var_c + eps) * w_c)``
for every element in one pass, the per-channel factor recomputed from the
running variance and the weight where it is needed: the forward then runs
the plain norm alone (one launch, as the plain module's) instead of also
computing the factor (three small launches). The float32 operations are
the PyTorch path's (``FrozenAffineNormFunction``): ``var + eps``, its
``rsqrt``, the product with the weight, the product with ``g``, rounded to
``g``'s dtype.

``_frozen_layer_norm_backward`` writes a frozen layer norm's input
gradient, ``rstd * (g w - mean(g w) - x^ mean(g w x^))`` per row with
``x^ = (x - mean(x)) * rstd``, in one pass over ``x`` and ``g`` (one row
per program lane, the row's mean recomputed from ``x``): the PyTorch path
takes the mean (a cast and a reduction), then autograd's own backward
kernel. Equal to it up to rounding (the order of the row sums).

Importing this module imports ``triton`` (:mod:`.triton_norm` imports it
lazily).
"""
import triton
import triton.language as tl
from torch import Tensor

from ..backend.launch_geometry import cdiv, next_power_of_2
from ..backend.triton_launch import LAUNCH_OPTIONS

# Elements per program. A heuristic, not tuned on a GPU.
_BLOCK = 1024


#: The tensor arguments each kernel writes (the others it reads): the
#: bytes a launch moves, for :mod:`mmseg_gf.accounting.launches`.
KERNEL_OUTPUTS = {'_frozen_norm_backward': ('out', ),
                  '_frozen_layer_norm_backward': ('out', )}


@triton.jit
def _frozen_norm_backward(g, var, weight, out, numel, inner, channels, eps,
                          HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    c = (i // inner) % channels
    scale = tl.math.rsqrt(tl.load(var + c, mask=ok, other=1.).to(tl.float32)
                          + eps)
    if HAS_WEIGHT:
        scale = scale * tl.load(weight + c, mask=ok, other=0.).to(tl.float32)
    v = tl.load(g + i, mask=ok, other=0.).to(tl.float32)
    tl.store(out + i, (v * scale).to(out.dtype.element_ty), mask=ok)


def frozen_norm_backward(grad: Tensor, running_var: Tensor, weight, eps: float,
                         inner: int, out: Tensor) -> Tensor:
    """``out = grad * scale`` per channel (``grad`` and ``out`` dense, in
    the same memory order, ``inner`` elements per channel run in it: the
    product of the spatial sizes for NC..., 1 for channels-last)."""
    numel = grad.numel()
    _frozen_norm_backward[(cdiv(numel, _BLOCK), )](
        grad, running_var, running_var if weight is None else weight, out,
        numel, int(inner), grad.shape[1], float(eps),
        HAS_WEIGHT=weight is not None, BLOCK=_BLOCK, **LAUNCH_OPTIONS)
    return out


@triton.jit
def _frozen_layer_norm_backward(g, x, rstd, weight, out, rows, dim,
                                HAS_WEIGHT: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < rows
    ok = r_ok[:, None] & (d < dim)[None, :]
    offs = r[:, None] * dim + d[None, :]
    xv = tl.load(x + offs, mask=ok, other=0.).to(tl.float32)
    gv = tl.load(g + offs, mask=ok, other=0.).to(tl.float32)
    s = tl.load(rstd + r, mask=r_ok, other=0.).to(tl.float32)[:, None]
    mean = tl.sum(xv, axis=1) / dim
    xhat = tl.where(ok, (xv - mean[:, None]) * s, 0.)
    if HAS_WEIGHT:
        gv = gv * tl.load(weight + d, mask=d < dim,
                          other=0.).to(tl.float32)[None, :]
    mean_gx = tl.sum(gv * xhat, axis=1) / dim
    mean_g = tl.sum(gv, axis=1) / dim
    gx = s * (gv - mean_g[:, None] - xhat * mean_gx[:, None])
    tl.store(out + offs, gx.to(out.dtype.element_ty), mask=ok)


#: The longest normalized row one program holds (longer: the PyTorch path).
MAX_ROW = 8192


def frozen_layer_norm_backward(grad: Tensor, x: Tensor, rstd: Tensor,
                               weight, dim: int, out: Tensor) -> Tensor:
    """``out``: the input gradient of ``layer_norm`` over the last ``dim``
    elements of each row (``grad``, ``x``, ``out`` contiguous; ``rstd``
    one value per row; ``weight`` ``dim`` values or None), the mean
    recomputed from ``x``."""
    rows = x.numel() // dim
    block_d = next_power_of_2(dim)
    block_r = max(1, min(next_power_of_2(rows), 4096 // block_d))
    _frozen_layer_norm_backward[(cdiv(rows, block_r), )](
        grad, x, rstd, x if weight is None else weight, out, rows, dim,
        HAS_WEIGHT=weight is not None, BLOCK_R=block_r, BLOCK_D=block_d,
        **LAUNCH_OPTIONS)
    return out
