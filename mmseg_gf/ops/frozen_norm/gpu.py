"""Frozen norms on the GPU: the backward in one Triton pass each
(:mod:`.triton_norm_kernels`).

Batch norm (:class:`FrozenBatchNormFunction`): on the PyTorch path
(:class:`~.lean.FrozenAffineNormFunction`) the forward
computes the per-channel factor ``rsqrt(var + eps) * w`` (three small
launches) before the norm itself, and the backward multiplies (one more
cast each way under autocast). Here the forward is the plain norm only and
the backward one launch that recomputes the factor per element from the
running variance and the weight, which are referenced, not saved (a buffer
and a Parameter, alive anyway; an in-place change between forward and
backward is an error, as autograd reports for a saved tensor). Same
float32 operations, so the same gradient bit for bit (where ``rsqrt``
rounds as torch's).

Layer norm (:func:`frozen_layer_norm_backward`, called by
:class:`~.lean_transformer.FrozenLayerNormFunction`'s backward): one pass
over the kept input and ``g`` instead of the mean's recomputation and
autograd's own kernel; equal to it up to rounding.

Taken by float32 / float16 / bfloat16 CUDA inputs (batch norm:
contiguous or channels-last; layer norm: contiguous), in eager mode, where
the Triton path is switched on (:func:`triton_runtime.takes_device`); on CPU
only under the interpreter.
"""
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from ..backend import dispatch, triton_runtime
from ..backend.triton_runtime import is_fake, on_device
from ..function_output import owned_output

__all__ = ['refusal', 'usable', 'FrozenBatchNormFunction', 'reference_norm',
           'unchanged_norm', 'layer_norm_usable', 'layer_norm_refusal',
           'frozen_layer_norm_backward']

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: ``triton_norm_kernels.MAX_ROW`` (not imported: it imports triton).
_MAX_ROW = 8192


def _inner(t: Tensor) -> Optional[int]:
    """Elements of one channel in a run of ``t``'s memory order: the
    spatial size for a contiguous tensor, 1 for a channels-last one, None
    for any other layout."""
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
    None."""
    reason = triton_runtime.device_refusal(x)
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
    """Whether the dispatcher's ``frozen_norm`` lets ``x`` take the
    Triton path (:func:`refusal` gives no reason)."""
    return dispatch.refusal('frozen_norm', 'triton', x) is None


def reference_norm(ctx, running_var: Tensor,
                   weight: Optional[Tensor]) -> None:
    """Keep a frozen norm's running variance and weight on ``ctx`` by
    reference (a buffer and a Parameter, alive anyway), with their versions
    (:func:`unchanged_norm` checks them)."""
    ctx.refs = (running_var, weight)
    ctx.versions = tuple(-1 if t is None else t._version for t in ctx.refs)


def unchanged_norm(ctx) -> Tuple[Tensor, Optional[Tensor]]:
    """The references :func:`reference_norm` kept, after checking that
    neither changed in place since (as autograd checks a saved tensor)."""
    for t, version in zip(ctx.refs, ctx.versions):
        if t is not None and t._version != version:
            raise RuntimeError(
                'the running variance or weight of a frozen norm was '
                'modified in place between its forward and backward '
                f'(version {version} -> {t._version})')
    return ctx.refs


class FrozenBatchNormFunction(Function):
    """``normalize(x)`` (the frozen norm's own forward), backward ``g *
    rsqrt(running_var + eps) * weight`` in one Triton launch."""

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
        from . import kernels as triton_norm_kernels  # imports triton
        with on_device(grad):
            g_x = triton_norm_kernels.frozen_norm_backward(
                grad, running_var, weight, ctx.eps, inner,
                torch.empty_like(grad))
        return g_x, None, None, None, None


def layer_norm_refusal(x: Tensor, dims: int) -> Optional[str]:
    """Why a frozen layer norm's backward over the last ``dims``
    dimensions of its kept input ``x`` may not take the Triton path
    (contiguous ``x``, rows of at most 8192 elements), or None."""
    reason = triton_runtime.device_refusal(x)
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
    """Whether the dispatcher's ``frozen_layer_norm`` takes the Triton
    path for ``x``."""
    return dispatch.refusal('frozen_layer_norm', 'triton', x, dims) is None


def frozen_layer_norm_backward(grad: Tensor, x: Tensor, rstd: Tensor,
                               weight: Optional[Tensor],
                               dims: int) -> Tensor:
    """The input gradient of ``layer_norm`` over the last ``dims``
    dimensions of a :func:`layer_norm_usable` ``x`` (``rstd`` per row, as
    the forward returned it; the mean recomputed), contiguous in ``x``'s
    dtype."""
    row = x.numel() // max(1, rstd.numel())
    from . import kernels as triton_norm_kernels  # imports triton
    with on_device(x):
        return triton_norm_kernels.frozen_layer_norm_backward(
            grad.contiguous(), x, rstd.contiguous(),
            None if weight is None else weight.contiguous(), row,
            torch.empty_like(x, memory_format=torch.contiguous_format))
