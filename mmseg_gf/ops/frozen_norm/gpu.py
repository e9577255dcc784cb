"""Frozen norms on the GPU: the backward in one Triton pass each.

Batch norm (:class:`FrozenBatchNormFunction`): the forward is the plain
norm only; the backward recomputes ``rsqrt(var + eps) * w`` per element
from the running variance and weight, referenced rather than saved (an
in-place change is an error, as for a saved tensor): the same float32
operations, so the same gradient bit for bit. Layer norm
(:func:`frozen_layer_norm_backward`): one pass over the kept input and
``g``, equal to autograd's to rounding. Eager mode, float32 / float16 /
bfloat16 CUDA tensors; on CPU only under the interpreter.
"""
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from ..backend import availability, dispatch
from ..backend.triton_runtime import is_fake, lazy_module, on_device
from ..function_output import owned_output

__all__ = ['refusal', 'usable', 'FrozenBatchNormFunction', 'reference_norm',
           'unchanged_norm', 'layer_norm_usable', 'layer_norm_refusal',
           'frozen_layer_norm_backward']

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: ``triton_norm_kernels.MAX_ROW`` (not imported: it imports triton).
_MAX_ROW = 8192

def _import_kernels():
    from . import kernels as triton_norm_kernels  # imports triton: when used
    return triton_norm_kernels


_kernels = lazy_module(_import_kernels)


def _inner(t: Tensor) -> Optional[int]:
    """Elements of one channel in a run of ``t``'s memory order (contiguous:
    the spatial size; channels-last: 1; else None).
    """
    if t.is_contiguous():
        inner = 1
        for size in t.shape[2:]:
            inner *= size
        return inner
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return 1
    return None


def refusal(x: Tensor) -> Optional[str]:
    """Why a frozen norm's input ``x`` may not take the Triton path, or
    None.
    """
    reason = availability.triton_refusal(x)
    if reason is not None:
        return reason
    if x.dtype not in _DTYPES:
        return f'{x.dtype} input'
    if x.dim() < 2 or x.numel() == 0 or _inner(x) is None:
        return 'empty, 1-D, or neither contiguous nor channels-last'
    if torch.compiler.is_compiling() or is_fake(x):
        return 'compiling or a fake tensor'
    return None


def usable(x: Tensor) -> bool:
    """Whether ``x`` takes the Triton path of ``frozen_norm``."""
    return dispatch.refusal('frozen_norm', 'triton', x) is None


def reference_norm(ctx, running_var: Tensor,
                   weight: Optional[Tensor]) -> None:
    """Keep a frozen norm's running variance and weight on ``ctx`` by
    reference, with their versions.
    """
    ctx.refs = (running_var, weight)
    ctx.versions = tuple(-1 if t is None else t._version for t in ctx.refs)


def unchanged_norm(ctx) -> Tuple[Tensor, Optional[Tensor]]:
    """The references of :func:`reference_norm`, checked unchanged in place."""
    for t, version in zip(ctx.refs, ctx.versions):
        if t is not None and t._version != version:
            raise RuntimeError(
                'the running variance or weight of a frozen norm was '
                'modified in place between its forward and backward '
                f'(version {version} -> {t._version})')
    return ctx.refs


class FrozenBatchNormFunction(Function):
    """The frozen norm's own forward; backward ``g * rsqrt(running_var + eps) *
    weight`` in one Triton launch.
    """

    @staticmethod
    def forward(ctx, x: Tensor, running_var: Tensor, weight: Optional[Tensor],
                eps: float, normalize: Callable[[Tensor], Tensor]) -> Tensor:
        reference_norm(ctx, running_var, weight)
        ctx.eps = float(eps)
        return owned_output(normalize(x), x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        running_var, weight = unchanged_norm(ctx)
        inner = _inner(grad)
        if inner is None:
            grad = grad.contiguous()
            inner = _inner(grad)
        triton_norm_kernels = _kernels()
        with on_device(grad):
            g_x = triton_norm_kernels.frozen_norm_backward(
                grad, running_var, weight, ctx.eps, inner,
                torch.empty_like(grad))
        return g_x, None, None, None, None


def layer_norm_refusal(x: Tensor, dims: int) -> Optional[str]:
    """Why a frozen layer norm's backward may not take the Triton path
    (contiguous ``x``, rows of at most 8192 elements), or None.
    """
    reason = availability.triton_refusal(x)
    if reason is not None:
        return reason
    if x.dtype not in _DTYPES:
        return f'{x.dtype} input'
    if x.numel() == 0 or not x.is_contiguous():
        return 'empty or not contiguous'
    if torch.compiler.is_compiling() or is_fake(x):
        return 'compiling or a fake tensor'
    row = 1
    for size in x.shape[x.dim() - dims:]:
        row *= size
    if not 0 < row <= _MAX_ROW:
        return f'rows of {row} elements (at most {_MAX_ROW})'
    return None


def layer_norm_usable(x: Tensor, dims: int) -> bool:
    """Whether ``frozen_layer_norm`` takes the Triton path for ``x``."""
    return dispatch.refusal('frozen_layer_norm', 'triton', x, dims) is None


def frozen_layer_norm_backward(grad: Tensor, x: Tensor, rstd: Tensor,
                               weight: Optional[Tensor],
                               dims: int) -> Tensor:
    """The input gradient of ``layer_norm`` over the last ``dims`` dimensions
    (``rstd`` per row from the forward; the mean recomputed), in ``x``'s
    dtype.
    """
    row = x.numel() // max(1, rstd.numel())
    triton_norm_kernels = _kernels()
    with on_device(x):
        return triton_norm_kernels.frozen_layer_norm_backward(
            grad.contiguous(), x, rstd.contiguous(),
            None if weight is None else weight.contiguous(), row,
            torch.empty_like(x, memory_format=torch.contiguous_format))
