"""A loss whose gradient is computed in the forward.

A segmentation head's loss is the only consumer of its logits, and a
training step differentiates it exactly once. So its gradient w.r.t. the
low-resolution logits can be taken while the forward runs, on a detached
copy of the logits, and kept instead of what autograd would keep to take it
later (the upsampled logits, their log-softmax, OHEM's sorted
probabilities, ...). The backward then only scales the kept gradients by
the incoming ones: a loss output ``L_k`` with incoming gradient ``c_k``
contributes ``c_k * dL_k/dz``. Loss scaling (AMP) and gradient accumulation
only change ``c_k``, so they stay exact; the loss itself runs once, with
autograd, as the plain path runs it (so a loss that draws random numbers
draws the same ones).

:class:`PrecomputedGradientLossFunction` does this for any loss of one or
several logits tensors; :mod:`.fused_classifier` goes one step further for
a head's classifier.

No mmseg import: the mmseg heads are wired in by :mod:`mmseg_gf.models.lean`.
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

    The gradient of output ``k`` is ``sum(c * bases[b] for b, c in
    mix[k])``: a loss whose outputs share one gradient up to a factor (a
    cross-entropy under several weights) keeps one basis.

    Attributes:
        values: every output (detached), in output order.
        bases: gradient tensors, the logits' shape.
        mix: output key -> ``[(basis index, factor)]``.
        others: output key -> its gradient w.r.t. each further logits
            tensor the loss reads (a head returning a tuple of logits; None
            where it does not depend on one). Outputs in neither ``mix``
            nor ``others`` are not differentiable (accuracy).
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
    """Autograd on, for a graph built and differentiated inside a forward.

    Its saved tensors are freed before the forward returns, so they are
    not kept for the step's backward: identity saved-tensor hooks keep
    them away from any hooks around the step (an offloading hook, or a
    measurement of what the step keeps). The hooks save a detached alias
    (same storage, same version counter), so that a graph part no
    gradient call traverses (OHEM's softmax, a loss output differentiated
    with ``retain_graph``) is freed by reference counting as soon as its
    outputs are, as it is without hooks.
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
    """Run ``compute(*leaves)`` with autograd on detached copies of
    ``logits`` and differentiate each scalar ``loss*`` output.

    Only the logits in ``needs`` are leaves that require a gradient, so a
    loss term of logits nothing trains (a frozen auxiliary branch's)
    builds no graph, as on the plain path. Each output is differentiated
    on its own (its gradient stays separately scalable) and dropped right
    after, so the graph part only it uses is freed before the next one's
    gradient is taken.

    Args:
        params: trainable tensors the loss must not depend on (the
            gradient kept is w.r.t. the logits only).
        needs: which logits need a gradient (default: all).

    Returns:
        ``(values, grads)``: every output detached, and for each
        differentiable loss output its gradient w.r.t. each logits tensor
        (None where it does not depend on it or it is not needed).

    Raises:
        ValueError: a differentiable loss output is not a scalar, or it
            depends on one of ``params``.
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
    """Loss outputs of logits tensors, differentiated in the forward.

    Inputs: ``compute`` (logits -> dict of outputs, e.g. a head's
    ``loss_by_feat``), ``keys`` (a list that receives the dict's keys in
    output order), ``params`` (see :func:`loss_gradients`), then the
    logits tensors. Keeps each loss output's gradient w.r.t. each logits
    tensor it depends on (at the logits' resolution), nothing else;
    outputs without ``loss`` in their key are non-differentiable.
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
    """Loss outputs of one logits tensor whose gradients a function computes
    in the forward (without autograd, e.g. a compiled kernel).

    Inputs: ``gradients`` (detached logits -> :class:`LogitGradients`),
    ``keys`` (receives the output keys), the logits. Keeps the gradient
    bases, nothing else; the backward scales them by the incoming
    gradients. Outputs outside ``mix`` are non-differentiable.
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
