"""A loss whose gradient is computed in the forward.

A head's loss is its logits' only consumer and is differentiated once, so
its gradient w.r.t. the low-resolution logits is taken in the forward and
kept instead of what autograd would keep (upsampled logits, log-softmax).
The backward scales it by the incoming gradient, so AMP loss scaling and
accumulation stay exact; the loss runs once, as on the plain path (same
random draws). No mmseg import.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd import Function

from .scaling import (basis_scales, flatten_gradients, function_outputs,
                      recombine_gradients, scaled_sum)
from ..lean.kept_sources import note_sources

__all__ = ['LogitGradients', 'forward_graph', 'loss_gradients',
           'PrecomputedGradientLossFunction', 'KeptGradientLossFunction']


@dataclass
class LogitGradients:
    """A loss's outputs and their gradients w.r.t. one logits tensor.

    Output ``k``'s gradient is ``sum(c * bases[b] for b, c in mix[k])``, so
    outputs equal up to a factor share a basis.

    Attributes:
        values: every output (detached), in output order.
        bases: gradient tensors, the logits' shape.
        mix: output key -> ``[(basis index, factor)]``.
        others: output key -> its gradient w.r.t. each further logits tensor
            (None where independent). Outputs in neither are not
            differentiable.
    """

    values: Dict[str, Tensor]
    bases: List[Tensor] = field(default_factory=list)
    mix: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)
    others: Dict[str, Tuple[Optional[Tensor], ...]] = field(
        default_factory=dict)


def _pack_detached(tensor: Tensor) -> Tensor:
    # Not the tensor itself: a saved output would then hold its own
    # autograd node (tensor -> grad_fn -> packed tensor), a cycle through
    # C++ that neither reference counting nor the garbage collector frees.
    # Autograd re-attaches the node when it unpacks a saved output.
    return tensor.detach()


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@contextlib.contextmanager
def forward_graph():
    """Autograd on for a graph built and differentiated inside a forward, its
    saved tensors kept from hooks around the step (offloading, measuring).
    """
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
            _pack_detached, _identity):
        yield


def _differentiable_losses(out: Dict[str, Tensor]) -> List[str]:
    keys = [k for k, v in out.items() if 'loss' in k and v.requires_grad]
    for k in keys:
        if out[k].numel() != 1:
            raise ValueError(
                f'loss output {k!r} has shape {tuple(out[k].shape)}: only '
                'scalar losses can have their gradient taken in the forward')
    return keys


def loss_gradients(compute: Callable[..., Dict[str, Tensor]],
                   logits: Sequence[Tensor],
                   params: Sequence[Tensor] = (),
                   needs: Optional[Sequence[bool]] = None
                   ) -> Tuple[Dict[str, Tensor],
                              Dict[str, Tuple[Optional[Tensor], ...]]]:
    """Run ``compute(*leaves)`` on detached ``logits`` and differentiate each
    scalar ``loss*`` output on its own; only logits in ``needs`` (default
    all) require a gradient.

    Returns:
        ``(values, grads)``: detached outputs and each differentiable output's
        gradient per logits tensor (None where independent or not needed).

    Raises:
        ValueError: a differentiable output is not a scalar, or depends on
            one of ``params``.
    """
    needs = [True] * len(logits) if needs is None else list(needs)
    leaves = [t.detach().requires_grad_(bool(n))
              for t, n in zip(logits, needs)]
    wanted = [t for t in leaves if t.requires_grad]
    params = list(params)
    with forward_graph():
        pending = compute(*leaves)
        values = {k: v.detach() for k, v in pending.items()}
        pending = {k: pending[k] for k in _differentiable_losses(pending)}
        grads = {}
        while pending:
            key = next(iter(pending))
            found = torch.autograd.grad(pending.pop(key), wanted + params,
                                        allow_unused=True,
                                        retain_graph=bool(pending))
            if any(g is not None for g in found[len(wanted):]):
                raise ValueError(f'loss output {key!r} depends on trainable '
                                 'parameters besides the logits')
            per_wanted = iter(found[:len(wanted)])
            grads[key] = tuple(next(per_wanted) if t.requires_grad else None
                               for t in leaves)
    return values, grads


class PrecomputedGradientLossFunction(Function):
    """Loss outputs of logits tensors, differentiated in the forward by
    :func:`loss_gradients`; keeps each output's gradient per logits tensor.
    """

    @staticmethod
    def forward(ctx, compute: Callable[..., Dict[str, Tensor]],
                keys: List[str], params: Sequence[Tensor], *logits: Tensor):
        values, grads = loss_gradients(compute, logits, params,
                                       ctx.needs_input_grad[3:])
        keys.extend(values)
        ctx.keys = list(values)
        ctx.layout, kept = flatten_gradients(grads, ctx.keys)
        note_sources(kept, [logits[j] for _, j in ctx.layout])
        ctx.save_for_backward(*kept)
        ctx.num_logits = len(logits)
        return function_outputs(ctx, values, grads, logits)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None, None) + recombine_gradients(
            ctx.layout, ctx.saved_tensors, grad_outputs, ctx.num_logits)


class KeptGradientLossFunction(Function):
    """Loss outputs of one logits tensor whose :class:`LogitGradients` a
    callable computes without autograd (a compiled kernel); keeps the bases.
    """

    @staticmethod
    def forward(ctx, gradients: Callable[[Tensor], LogitGradients],
                keys: List[str], logits: Tensor):
        result = gradients(logits.detach())
        keys.extend(result.values)
        ctx.keys, ctx.mix = list(result.values), result.mix
        note_sources(result.bases, [logits] * len(result.bases))
        ctx.save_for_backward(*result.bases)
        return function_outputs(ctx, result.values, result.mix, (logits, ))

    @staticmethod
    def backward(ctx, *grad_outputs):
        bases = ctx.saved_tensors
        scales = basis_scales(ctx.keys, ctx.mix, grad_outputs)
        if not scales:
            return None, None, None
        return None, None, scaled_sum(
            [(s, bases[b]) for b, s in scales.items()], bases[0])
